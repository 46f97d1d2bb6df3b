"""Peer-to-peer backend on hivemind: volunteers join and leave, payloads travel over libp2p streams.

One ``all_gather`` is one *round* (numbered by step) in up to three phases, all under one deadline
``step_timeout_s`` counted from the moment this peer enters the round:

1. gather (until ``gather_fraction * step_timeout_s``): push this peer's payload to every active
   peer of the DHT view (and to any peer that pushed to us this round); collect theirs. A peer whose
   payload has not arrived by then is left out of the step; its payload, if it comes later, is
   answered LATE and dropped.
2. agree (until ``0.8 * step_timeout_s``): send every peer whose payload we hold a vote (the digests
   of all payloads we hold); wait for their votes; the contributors are ``hivemind_wire.agree``: the
   payloads held by everyone who voted. The result is returned sorted by peer id, so every peer
   reduces in the same order.
3. adopt (until ``step_timeout_s``, rare): if a voter holds payloads we never received, it counted
   votes we could not see, so we take its contributor set (and payloads) from its log of recent
   rounds instead of ours. Likewise, when every peer we reached answered LATE, we are behind (a
   slow or freshly joined peer) and take a finished peer's result: we apply exactly what it applied.

When every vote reaches every voter, all peers compute the same set. What can still slip through
(a peer that vanishes between sending its vote to some peers and to others; a malicious voter) is
caught by the replica checksum the peer program compares every K steps through the DHT
(``publish_checksum``/``compare_checksum``); a peer in the minority reloads state.

The backend never looks inside a payload; it enforces the size (every payload of a round must have
the size of this peer's own; a larger length field closes the stream before the body is read) and
excludes a sender for ``exclude_s`` when its size is wrong, when the program's ``payload_validator``
(built from the optimizer's codec) rejects it before the vote, or when the optimizer reports it
invalid after the step (``report_invalid``). ``stats`` counts every byte of the gather streams
(hello, status, payload and vote frames), not the occasional log or state downloads.

NAT: a ``client_mode=True`` peer accepts no streams; it opens one to every server and the server
answers on it (flag REPLY), so it trains like the others but cannot serve logs or state. Two
client-mode peers never reach each other directly; the agreement then leaves one of them out of the
step (its payload is not held by everyone). Relays fix that: hivemind's libp2p daemon has circuit
relays on by default (``use_relay=True``); a NAT-ed peer that passes ``dht_kwargs=dict(
use_auto_relay=True)`` (or ``trusted_relays=[maddr]`` for a relay you host on a public machine)
becomes reachable through a relay and can then run as a normal (server) peer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import re
import threading
import time

import torch
from hivemind import DHT
from hivemind.p2p import P2P

from .base import Backend, CommStats, PendingGather, check_buffer, check_reduce
from .hivemind_membership import ACTIVE, Membership, check_heartbeat, majority
from . import hivemind_wire as wire
from .hivemind_catchup import CatchUp, HivemindBackendError
from .hivemind_round import GatherStreams, Round

logger = logging.getLogger(__name__)

VOTE_FRACTION = 0.8  # votes are awaited until 0.8 of the step deadline; the rest is for adopting a log
RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

__all__ = ["HivemindBackend", "HivemindBackendError", "dht_options"]


def dht_options(host_maddrs, dht_kwargs: dict | None) -> dict:
    """``dht_kwargs``, plus ``nat_port_map=False`` when every listen address is a loopback one.

    libp2p's NAT port mapping otherwise probes the local network (UPnP M-SEARCH to 239.255.255.250,
    NAT-PMP to the gateway) even for a peer that listens on 127.0.0.1 only and has nothing to map.
    """
    options = dict(dht_kwargs or {})
    if all(is_loopback_maddr(m) for m in host_maddrs):
        options.setdefault("nat_port_map", False)
    return options


def is_loopback_maddr(maddr) -> bool:
    """Whether a multiaddr such as ``/ip4/127.0.0.1/tcp/0`` names a loopback address."""
    parts = str(maddr).split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    try:
        return ipaddress.ip_address(parts[2]).is_loopback
    except ValueError:
        return False


def check_settings(
    run_id, *, step_timeout_s, gather_fraction, exclude_s, heartbeat_s, ttl_s, max_peers,
    max_state_nbytes, state_timeout_s, log_rounds, startup_timeout_s,
) -> None:
    """Refuse bad settings before anything starts: a refusal after the DHT started would leak it."""
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise ValueError(f"Invalid run_id: {run_id!r} (1-64 characters of A-Z a-z 0-9 _ . -)")
    if not 0 < gather_fraction < VOTE_FRACTION:
        raise ValueError(f"Invalid gather_fraction: {gather_fraction!r} (expected in (0, {VOTE_FRACTION}))")
    check_heartbeat(heartbeat_s, ttl_s)
    for name, seconds in (
        ("step_timeout_s", step_timeout_s),
        ("state_timeout_s", state_timeout_s),
        ("startup_timeout_s", startup_timeout_s),
    ):
        if not seconds > 0:
            raise ValueError(f"Invalid {name}: {seconds!r} (expected a number of seconds > 0)")
    if not exclude_s >= 0:
        raise ValueError(f"Invalid exclude_s: {exclude_s!r} (expected a number of seconds >= 0)")
    # log_rounds >= 1: a log of 0 rounds drops each round as it ends, so no late peer could catch up
    for name, count, least in (("max_peers", max_peers, 1), ("log_rounds", log_rounds, 1),
                               ("max_state_nbytes", max_state_nbytes, 0)):
        if not isinstance(count, int) or isinstance(count, bool) or count < least:
            raise ValueError(f"Invalid {name}: {count!r} (expected an int >= {least})")


class HivemindBackend(GatherStreams, CatchUp, Backend):
    """A ``Backend`` whose workers are hivemind peers; see the module docstring for the protocol."""

    drops_invalid_payloads = True  # the optimizer drops a bad payload and calls report_invalid

    def __init__(
        self,
        run_id: str,
        initial_peers=(),
        host_maddrs=("/ip4/127.0.0.1/tcp/0",),
        dht: DHT | None = None,
        *,
        step_timeout_s: float = 10.0,
        gather_fraction: float = 0.5,
        allow_peers=None,
        client_mode: bool = False,
        exclude_s: float = 60.0,
        heartbeat_s: float = 1.0,
        ttl_s: float = 4.0,
        max_peers: int = 256,
        max_state_nbytes: int = 1 << 32,
        state_timeout_s: float = 60.0,
        log_rounds: int = 32,
        startup_timeout_s: float = 30.0,
        dht_kwargs: dict | None = None,
    ):
        check_settings(
            run_id, step_timeout_s=step_timeout_s, gather_fraction=gather_fraction, exclude_s=exclude_s,
            heartbeat_s=heartbeat_s, ttl_s=ttl_s, max_peers=max_peers, max_state_nbytes=max_state_nbytes,
            state_timeout_s=state_timeout_s, log_rounds=log_rounds, startup_timeout_s=startup_timeout_s,
        )
        self.run_id, self.client_mode = run_id, bool(client_mode)
        self.step_timeout_s, self.gather_fraction, self.exclude_s = step_timeout_s, gather_fraction, exclude_s
        self.max_peers, self.max_state_nbytes, self.state_timeout_s = (
            max_peers,
            max_state_nbytes,
            state_timeout_s,
        )
        self.log_rounds, self.startup_timeout_s = log_rounds, startup_timeout_s
        self.allow_peers = None if allow_peers is None else {str(p) for p in allow_peers}
        self.rank, self.world_size, self.stats = 0, 1, CommStats()
        self.state_lock = threading.RLock()  # hold it around a training step so state snapshots are whole
        self.state_provider = None  # () -> tree of tensors, served to joining peers
        # (uint8 tensor) -> bool, set by the program from the optimizer's codec: payloads that fail it
        # are dropped before the vote, so a garbage sender never counts in the agreement
        self.payload_validator = None
        self.out_of_sync = False  # set when a round could not be completed like the others did it
        self.last_contributors: list[str] = []
        self._excluded: dict[str, float] = {}
        self._excluded_lock = threading.Lock()
        self._rounds: dict[int, Round] = {}
        self._finished: set[int] = set()
        self._log: dict[int, list[tuple[str, bytes]]] = {}
        self._low = self._next = 0
        self._own_dht, self.dht = dht is None, dht
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"hm-backend-{run_id}", daemon=True
        )
        self._p2p: P2P | None = None
        self._protocols = {
            f"distro/{run_id}/gather": self._on_gather,
            f"distro/{run_id}/log": self._on_log,
            f"distro/{run_id}/state": self._on_state,
        }
        self._handlers: list[str] = []  # the protocols this backend registered, which close() removes
        self.membership: Membership | None = None
        try:
            self._start(initial_peers, host_maddrs, dht_kwargs, heartbeat_s, ttl_s)
        except BaseException as exc:
            self.close()  # a failed start leaves no DHT, daemon handler or thread behind
            if isinstance(exc, (TimeoutError, concurrent.futures.TimeoutError)):
                raise HivemindBackendError(
                    "the DHT or its p2p daemon did not answer within "
                    f"startup_timeout_s={startup_timeout_s:g}"
                ) from exc
            raise

    def _start(self, initial_peers, host_maddrs, dht_kwargs, heartbeat_s: float, ttl_s: float) -> None:
        """Start the DHT (unless given one), our event loop, p2p client, stream handlers and heartbeats;
        every wait is bounded by ``startup_timeout_s``."""
        if self._own_dht:
            self.dht = DHT(
                initial_peers=[str(m) for m in initial_peers],
                host_maddrs=[str(m) for m in host_maddrs],
                client_mode=self.client_mode,
                start=False,
                **dht_options(host_maddrs, dht_kwargs),
            )
            self.dht.run_in_background(await_ready=True, timeout=self.startup_timeout_s)
        self._thread.start()  # after the DHT: hivemind forks its DHT process
        peer_id, daemon_maddr = self._ask_dht(_node_identity)
        self.peer_id = peer_id.to_base58()
        # our own client of the DHT's p2p daemon, bound to our event loop (dht.replicate_p2p() caches
        # one per DHT, which a second backend on the same DHT must not share)
        self._p2p = self._call(P2P.replicate(daemon_maddr), self.startup_timeout_s)
        if not self.client_mode:
            for name, handler in self._protocols.items():
                self._call(self._p2p.add_binary_stream_handler(name, handler), self.startup_timeout_s)
                self._handlers.append(name)
        self.membership = Membership(
            self.dht,
            self.run_id,
            self.peer_id,
            client=self.client_mode,
            heartbeat_s=heartbeat_s,
            ttl_s=ttl_s,
            dht_timeout_s=max(2.0, 2 * heartbeat_s),
        )
        self.membership.start()

    def _ask_dht(self, coro):
        """Run ``coro(dht, node)`` in the DHT process; wait at most ``startup_timeout_s`` (a hung DHT
        process would otherwise block for as long as it hangs)."""
        return self.dht.run_coroutine(coro, return_future=True).result(timeout=self.startup_timeout_s)

    # ----- public API -------------------------------------------------------------------------
    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddresses others pass as ``initial_peers`` to join this run."""
        try:
            return [str(m) for m in self._ask_dht(_visible_maddrs)]
        except concurrent.futures.TimeoutError:
            raise HivemindBackendError(
                f"the DHT did not report its addresses within startup_timeout_s={self.startup_timeout_s:g}"
            ) from None

    @property
    def step(self) -> int:
        """The number of the next round this peer will start."""
        return self._next

    def all_gather(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return self.start_all_gather(buf).wait()

    def start_all_gather(self, buf: torch.Tensor) -> PendingGather:
        check_buffer(buf)
        payload = buf.detach().to("cpu").contiguous().numpy().tobytes()
        step, self._next = self._next, self._next + 1
        self.membership.state, self.membership.step = ACTIVE, step
        future = asyncio.run_coroutine_threadsafe(self._gather(step, payload), self._loop)

        def wait():
            # the round bounds itself; the margin covers a log download after a LATE answer
            try:
                result = future.result(timeout=2 * self.step_timeout_s + 5)
            except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                future.cancel()
                raise HivemindBackendError(f"round {step} did not finish within its deadline") from None
            self.last_contributors = [p for p, _ in result]
            self.world_size = len(result)
            self.rank = (
                self.last_contributors.index(self.peer_id) if self.peer_id in self.last_contributors else -1
            )
            return [
                torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
                for _, b in result
            ]

        return PendingGather(wait)

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Gather every contributor's bytes and reduce the finite ones in contributor order."""
        check_reduce(tensor, op)
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        parts = self.all_gather(flat.view(torch.uint8).clone())
        values = [p.view(tensor.dtype) for p in parts if p.numel() == flat.numel() * flat.element_size()]
        values = [v for v in values if torch.isfinite(v).all()] or [flat]
        total = torch.stack(values).sum(0)
        if op == "mean":
            total = total / len(values)
        tensor.copy_(total.reshape(tensor.shape))
        return tensor

    def report_invalid(self, index_or_peer) -> None:
        """Exclude the sender of payload ``index`` of the last gather (or a peer id) for ``exclude_s``."""
        peer = self.last_contributors[index_or_peer] if isinstance(index_or_peer, int) else str(index_or_peer)
        if peer != self.peer_id:
            self._exclude(peer, "its payload was reported invalid")

    def wait_for_peers(self, n: int, timeout_s: float) -> int:
        """Announce this peer active, then block until ``n`` other active peers are in the view (or
        ``timeout_s``); return how many are. Peers that start a run together call this first, so
        that each one's first round already expects all the others."""
        self.membership.state = ACTIVE
        self.membership.beat()
        deadline = time.monotonic() + timeout_s
        while True:
            self.membership.refresh()
            count = sum(rec.state == ACTIVE for rec in self.membership.view().values())
            if count >= n or time.monotonic() >= deadline:
                return count
            time.sleep(0.2)

    def publish_checksum(self, step: int, checksum: str) -> None:
        self.membership.publish_checksum(step, checksum)

    def compare_checksum(self, step: int, checksum: str) -> list[str] | None:
        """``None`` when this peer agrees with the majority (or there is none); else the majority's peers."""
        reports = self.membership.checksums(step)
        reports[self.peer_id] = checksum
        value, holders = majority(reports)
        return None if value is None or value == checksum else holders

    def close(self) -> None:
        """Leave the run and release what this backend started (also what a failed start did)."""
        if self.membership is not None:
            self.membership.leave()
        if self._thread.is_alive():
            try:
                self._call(self._shutdown(), 10)
            except Exception as exc:  # noqa: BLE001 - closing must not raise
                logger.debug("hivemind backend shutdown: %s", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
        if self._own_dht and self.dht is not None:
            self.dht.shutdown()

    # ----- the round ---------------------------------------------------------------------------
    async def _gather(self, step: int, payload: bytes) -> list[tuple[str, bytes]]:
        r = self._round(step)
        try:
            return await self._run_round(r, payload)
        finally:
            if not r.finished.is_set():  # cancelled or failed: still close the round, or it blocks the log
                self._finish(r, [])

    async def _run_round(self, r: Round, payload: bytes) -> list[tuple[str, bytes]]:
        loop, step = asyncio.get_running_loop(), r.step
        now = loop.time()
        r.gather_deadline = now + self.gather_fraction * self.step_timeout_s
        r.vote_deadline = now + VOTE_FRACTION * self.step_timeout_s
        r.deadline = now + self.step_timeout_s
        r.own = payload
        r.own_ready.set()
        view = {
            p: rec for p, rec in self.membership.view().items() if rec.state == ACTIVE and self._admissible(p)
        }
        expected = {p for p, rec in view.items() if not (self.client_mode and rec.client)}
        for p in expected:
            if not view[p].client and p not in r.pushed:  # it may have contacted us first
                self._spawn_push(r, p)

        def gathered():
            # every peer's payload is here or will not come, and ours reached every peer we push to
            return all(p in r.payloads or p in r.no_payload for p in expected | r.streams) and all(
                p in r.push_over for p in r.pushed
            )

        await r.wait_until(gathered, r.gather_deadline)
        late = sorted(p for p in r.late if self._admissible(p))
        if not r.payloads and late:
            # everyone we reached has finished this step already: we are behind, take their result
            result = await self._adopt(r, late)
            if result is None:
                logger.warning(
                    "step %d finished without this peer and no peer served its log: out of sync", step
                )
                self.out_of_sync = True
            return self._finish(r, result or [])
        held = {p: wire.digest(p, b) for p, b in [(self.peer_id, payload), *r.payloads.items()]}
        r.my_vote = wire.encode_vote(step, held.values())
        r.phase1.set()
        await r.wait_until(lambda: all(p in r.vote_done for p in r.payloads), r.vote_deadline)
        votes = {p: v for p, v in r.votes.items() if p in r.payloads}
        agreed = wire.agree(held, votes)
        result = [(p, payload if p == self.peer_id else r.payloads[p]) for p in agreed]
        # a voter that holds payloads we never received counted votes we could not see: its
        # contributor set is the better-informed one, so apply that (see hivemind_wire.agree)
        informed = wire.better_informed(held, votes)
        if informed:
            adopted = await self._adopt(r, informed)
            if adopted is None:
                logger.warning("step %d: could not adopt a better-informed peer's contributors", step)
            result = adopted if adopted is not None else result
        logger.debug(
            "step %d held %s, votes of %s -> %s",
            step,
            _short(held),
            _short(votes),
            [_short1(p) for p, _ in result],
        )
        return self._finish(r, result)

    def _finish(self, r: Round, result):
        self._log[r.step] = result
        for old in [s for s in self._log if s <= r.step - self.log_rounds]:
            del self._log[old]
        self._finished.add(r.step)
        while self._low in self._finished:
            self._finished.discard(self._low)
            self._rounds.pop(self._low, None)
            self._low += 1
        self._rounds.pop(r.step, None)
        r.phase1.set()
        r.finished.set()
        # give votes in flight a moment to leave, then drop whatever still waits on this round
        self._loop.call_later(1.0, lambda: [t.cancel() for t in r.tasks])
        self.stats.record(0, 0)  # one more collective; its bytes were counted as they crossed
        return result

    async def _shutdown(self) -> None:
        for r in list(self._rounds.values()):
            for t in r.tasks:
                t.cancel()
        for name in self._handlers:  # only ours: another backend on this DHT may serve the same run
            try:
                await asyncio.wait_for(self._p2p.remove_binary_stream_handler(name), 2)
            except Exception:  # noqa: BLE001 - the daemon may already be gone
                pass
        if self._p2p is not None:
            await self._p2p.shutdown()  # a replica: closes our client, leaves the DHT's daemon to the DHT
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.wait(others, timeout=2) if others else None

    def _call(self, coro, timeout: float):
        """Run ``coro`` on the backend's event loop and wait for it at most ``timeout`` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise


async def _node_identity(_dht, node):
    return node.peer_id, node.p2p.daemon_listen_maddr


async def _visible_maddrs(_dht, node):
    return await node.get_visible_maddrs()


def _short1(peer: str) -> str:
    return peer[-6:]


def _short(held: dict) -> list[str]:
    return sorted(_short1(p) for p in held)
