"""Peer-to-peer backend on hivemind: volunteers join and leave, payloads travel over libp2p streams.

One ``all_gather`` is one *round* (numbered by step) in two phases, both under one deadline
``step_timeout_s`` counted from the moment this peer enters the round:

1. gather (until ``gather_fraction * step_timeout_s``): push this peer's payload to every active
   peer of the DHT view, to every peer whose payload the last round applied (unless it announced a
   clean leave: a heartbeat that lapses for a moment must not split the peers) and to any peer that
   pushed to us this round; collect theirs. A payload
   that has not arrived by then is left out of the step; if it comes later, it is answered LATE.
2. agree (until ``0.8 * step_timeout_s``): send every peer whose payload we hold a vote (the digests
   of all payloads we hold); wait for their votes; the contributors are ``hivemind_wire.agree``: the
   payloads held by everyone who voted, sorted by peer id, so every peer reduces in the same order.
   When ``untrusted_fraction`` > 0, a vote that lacks most of the other payloads is refused first
   (its voter's payload with it), so that one rogue cannot veto the honest payloads.

A round holds only what this peer checked itself: a payload counts when it came on its sender's own
stream (whose libp2p identity is the sender) and passed the program's ``payload_validator``; no
vote makes this peer apply bytes it did not receive. Nothing is relayed: a peer that finds the step
finished without it (half or more of the round's other peers answered LATE and never sent their
payloads; fewer count as missing payloads) abstains, applies nothing and sets ``out_of_sync``, so
that the program reloads state, which it takes only when a majority of the servers asked vouch for
it (``CatchUp.download_state``). When every vote reaches every
voter, all peers compute the same set; what can still slip through (a peer that vanishes between its
votes; a voter that tells peers different things;
a peer whose vote was refused because it received too little in time) is caught
by the replica checksum the peer program compares through the DHT every K steps
(``publish_checksum``/``compare_checksum``): a peer that does not hold the checksum the reports
choose reloads state (``replica_choice``: the most reported, the lowest between equals, so a 2-2 or
1-1 split heals too). Where nothing is chosen (three or more reports that all differ) nobody
reloads, and the comparison logs a warning.

DHT heartbeats and checksums are signed by the peer they name (``hivemind_records``); a given DHT
must be made with ``identity_path=`` (the key to sign with). ``allow_peers`` guards every stream this
peer serves and the checksum majority. The backend never looks inside a payload: it enforces sizes
(a length field above this peer's own payload's closes the stream unread) and excludes a sender for
``exclude_s`` for a wrong size, a payload ``payload_validator`` rejects, or one the optimizer reports
(``report_invalid``). ``untrusted_fraction`` > 0 says that up to that share of the
contributors may be rogues: the vote refuses ballots that veto most of a step, and the optimizer
aggregates with a trimmed mean (``distro_opt/robust.py``).
``stats`` counts the gather streams' bytes, ``state_stats`` the state streams'.

NAT: a ``client_mode=True`` peer accepts no streams; it opens one to every server, which answers on
it (flag REPLY). Two client-mode peers never exchange payloads, so a run holds at most one: a
client-mode peer that sees another one active refuses before its first round.

Parts wired together here: ``RoundRunner`` (the phases), ``GatherStreams`` (their bytes), ``CatchUp``
(state), ``RoundBook`` (rounds), ``Admission`` (allow list, exclusions), ``Membership`` (DHT view),
``StreamLink`` (event loop, p2p client); ``hivemind_wire`` has the frames.
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch
from hivemind import DHT

from .base import Backend, CommStats, PendingGather, check_buffer, check_reduce
from .hivemind_admission import Admission
from .hivemind_catchup import CatchUp, HivemindBackendError
from .hivemind_link import StreamLink
from .hivemind_membership import ACTIVE, Membership
from .hivemind_records import SignedRecordValidator, signer_of, start_dht
from .hivemind_round import RoundBook
from .hivemind_runner import RoundRunner
from .hivemind_settings import Settings, check_settings, dht_options
from .hivemind_streams import GatherStreams

__all__ = ["HivemindBackend", "HivemindBackendError", "check_settings", "dht_options"]


class HivemindBackend(Backend):
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
        startup_timeout_s: float = 30.0,
        dht_kwargs: dict | None = None,
        untrusted_fraction: float = 0.0,
    ):
        check_settings(
            run_id, step_timeout_s=step_timeout_s, gather_fraction=gather_fraction, exclude_s=exclude_s,
            heartbeat_s=heartbeat_s, ttl_s=ttl_s, max_peers=max_peers, max_state_nbytes=max_state_nbytes,
            state_timeout_s=state_timeout_s, startup_timeout_s=startup_timeout_s,
            untrusted_fraction=untrusted_fraction,
        )
        self.settings = Settings(
            run_id=run_id, client_mode=bool(client_mode), step_timeout_s=step_timeout_s,
            gather_fraction=gather_fraction, exclude_s=exclude_s, max_peers=max_peers,
            max_state_nbytes=max_state_nbytes, state_timeout_s=state_timeout_s,
            startup_timeout_s=startup_timeout_s, untrusted_fraction=float(untrusted_fraction),
        )
        self.rank, self.world_size, self.stats = 0, 1, CommStats()
        self.last_contributors: list[str] = []
        self._own_dht, self.dht = dht is None, dht
        self._book = RoundBook()
        self._admission = Admission(allow_peers, exclude_s)
        self._link = StreamLink(f"hm-backend-{run_id}")
        self._streams = GatherStreams(self.settings, self._book, self._admission, self.stats, self._link)
        self.state_lock = threading.RLock()  # hold it around a training step so state snapshots are whole
        self._catchup = CatchUp(self.settings, self._book, self._admission, self._link, self.state_lock)
        self.state_stats = self._catchup.stats
        self._closed = threading.Event()
        self._left = threading.Event()
        self._gathered = False  # whether this peer has started a round (see _refuse_a_second_client)
        self.membership: Membership | None = None
        self._runner: RoundRunner | None = None  # made once this peer knows its id and view
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
        settings, signer = self.settings, None
        if self._own_dht:
            self.dht, signer = start_dht(
                settings.startup_timeout_s, initial_peers=[str(m) for m in initial_peers],
                host_maddrs=[str(m) for m in host_maddrs], client_mode=settings.client_mode,
                **dht_options(host_maddrs, dht_kwargs),
            )
        self._link.start_loop()  # after the DHT: hivemind forks its DHT process
        peer_id, daemon_maddr = self._ask_dht(_node_identity)
        self.peer_id = peer_id.to_base58()
        signer = signer or signer_of(self.dht, self.peer_id)
        self._ask_dht(_add_record_validator)  # this DHT node stores and returns only signed records
        self._link.connect(daemon_maddr, settings.startup_timeout_s)
        if not settings.client_mode:
            handlers = {
                settings.protocol("gather"): self._streams.on_gather,
                settings.protocol("state"): self._catchup.on_state,
            }
            self._link.serve(handlers, settings.startup_timeout_s)
        self.membership = Membership(
            self.dht, settings.run_id, signer, client=settings.client_mode, heartbeat_s=heartbeat_s,
            ttl_s=ttl_s, dht_timeout_s=max(2.0, 2 * heartbeat_s), in_sync=lambda: not self._book.out_of_sync,
            allowed=self._admission.allowed,
        )
        self.membership.start()
        self._runner = RoundRunner(
            settings, self.peer_id, book=self._book, admission=self._admission, membership=self.membership,
            streams=self._streams, stats=self.stats, loop=self._link.loop,
        )

    def _ask_dht(self, coro):
        """Run ``coro(dht, node)`` in the DHT process; wait at most ``startup_timeout_s`` (a hung DHT
        process would otherwise block for as long as it hangs)."""
        future = self.dht.run_coroutine(coro, return_future=True)
        return future.result(timeout=self.settings.startup_timeout_s)

    # ----- what the program sets and reads ----------------------------------------------------
    @property
    def run_id(self) -> str:
        return self.settings.run_id

    @property
    def untrusted_fraction(self) -> float:
        """The share of contributors that may be rogues (fixed when the backend is made): above 0 the
        optimizer aggregates with a trimmed mean and the vote refuses vetoes (``hivemind_wire.agree``)."""
        return self.settings.untrusted_fraction

    @property
    def allow_peers(self) -> set[str] | None:
        """The peer ids this peer takes payloads from (``None``: any peer that is not excluded)."""
        return self._admission.allow_peers

    @allow_peers.setter
    def allow_peers(self, peers) -> None:
        self._admission.allow_peers = peers

    @property
    def payload_validator(self):
        """``(uint8 tensor) -> bool`` run on every payload before the vote (``None``: none)."""
        return self._streams.payload_validator

    @payload_validator.setter
    def payload_validator(self, validator) -> None:
        self._streams.payload_validator = validator

    @property
    def state_provider(self):
        """``() -> tree of tensors``, served to joining peers (``None``: this peer serves no state)."""
        return self._catchup.state_provider

    @state_provider.setter
    def state_provider(self, provider) -> None:
        self._catchup.state_provider = provider

    @property
    def state_digest(self):
        """``(tree) -> str``: the digest of a state that the peers' replicas hold alike, which a
        download must match (``CatchUp.download_state``); by default every byte of the state. The
        volunteer program digests the model only: each worker's optimizer state is its own."""
        return self._catchup.state_digest

    @state_digest.setter
    def state_digest(self, digest) -> None:
        self._catchup.state_digest = digest

    @property
    def out_of_sync(self) -> bool:
        """Set when a round could not be completed like the others did it (cleared by a state load)."""
        return self._book.out_of_sync

    @out_of_sync.setter
    def out_of_sync(self, value: bool) -> None:
        self._book.out_of_sync = value

    @property
    def visible_maddrs(self) -> list[str]:
        """Multiaddresses others pass as ``initial_peers`` to join this run."""
        try:
            return [str(m) for m in self._ask_dht(_visible_maddrs)]
        except concurrent.futures.TimeoutError:
            raise HivemindBackendError(
                "the DHT did not report its addresses within "
                f"startup_timeout_s={self.settings.startup_timeout_s:g}"
            ) from None

    @property
    def step(self) -> int:
        """The number of the next round this peer will start."""
        return self._book.next

    # ----- the Backend interface ---------------------------------------------------------------
    def all_gather(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return self.start_all_gather(buf).wait()

    def start_all_gather(self, buf: torch.Tensor) -> PendingGather:
        check_buffer(buf)
        if self._closed.is_set():
            raise HivemindBackendError("this peer left the run" if self._left.is_set() else "the backend is closed")
        if not self._gathered:
            self._refuse_a_second_client()
            self._gathered = True
        payload = buf.detach().to("cpu").contiguous().numpy().tobytes()
        step = self._book.take_next()
        self.membership.state, self.membership.step = ACTIVE, step
        future = self._link.submit(self._runner.run(step, payload))

        def wait():
            try:  # the round bounds itself; the margin is for an event loop slowed by other work
                result = future.result(timeout=2 * self.settings.step_timeout_s + 5)
            except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                future.cancel()
                raise HivemindBackendError(f"round {step} did not finish within its deadline") from None
            except concurrent.futures.CancelledError:
                raise HivemindBackendError(f"the backend was closed during round {step}") from None
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

    def _refuse_a_second_client(self) -> None:
        """Before its first round, a client-mode peer refuses to train in a run that already holds
        another one: two client-mode peers never exchange payloads (neither accepts a stream), so each
        would apply a different set at every step and the replicas would drift apart for good."""
        if not self.settings.client_mode:
            return
        others = sorted(
            p for p, rec in self.membership.view().items()
            if rec.client and rec.state == ACTIVE and self._admission.admits(p)
        )
        if others:
            raise HivemindBackendError(
                f"client-mode peer {', '.join(others)} is already in this run, and two client-mode peers "
                "never exchange payloads (neither accepts a stream), so their replicas would drift "
                "apart: run this peer where the others can reach it (a public or port-forwarded "
                "--host-maddrs address) instead of --client-mode"
            )

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
            self._admission.exclude(peer, "its payload was reported invalid")

    def leave(self) -> None:
        """Leave the run cleanly, now: announce it through the DHT (the others stop waiting for this
        peer at their next view) and answer REJECTED to every round this peer will not start, so
        that a round the others started before they saw the announcement does not wait for it
        either. State downloads already under way are still served until ``close()``; no new
        gather can start. Idempotent; ``close()`` leaves first."""
        if self._left.is_set():
            return
        self._left.set()
        self._closed.set()  # start_all_gather refuses from now on
        if self._link.loop.is_running():
            try:
                self._link.call(self._leave_rounds(), 5)
            except Exception:  # noqa: BLE001 - a loop that cannot answer is closed by close()
                pass
        if self.membership is not None:
            self.membership.leave()

    async def _leave_rounds(self) -> None:
        self._book.leave()  # on the event loop, which owns the rounds

    def close(self) -> None:
        """Leave the run and release what this backend started (also what a failed start did); a
        gather, ``wait_for_peers`` or state download waiting on another thread ends at once with
        ``HivemindBackendError`` (``wait_for_peers`` returns its count)."""
        self.leave()
        self._link.close(cancel_first=self._book.cancel_tasks)
        self._catchup.close()
        if self._own_dht and self.dht is not None:
            self.dht.shutdown()

    # ----- peers, checksums and state ----------------------------------------------------------
    def wait_for_peers(self, n: int, timeout_s: float) -> int:
        """Announce this peer active, then block until ``n`` other active peers are in the view (or
        ``timeout_s``); return how many are. Peers that start a run together call this first, so
        that each one's first round already expects all the others."""
        return self.membership.wait_for_active(n, timeout_s)

    def publish_checksum(self, step: int, checksum: str) -> None:
        self.membership.publish_checksum(step, checksum)

    def compare_checksum(self, step: int, checksum: str) -> list[str] | None:
        """``None`` when this peer holds the checksum the admitted peers' signed reports choose
        (``hivemind_membership.replica_choice``), or they choose none; else the peers holding it."""
        return self.membership.compare_checksum(step, checksum, self._admission.admits)

    def load_state_from_peers(self, prefer=None, timeout_s: float | None = None):
        """Download the state that more than half of the live peers asked vouch for (their step and
        ``state_digest``), from one of them, and take its step number."""
        candidates = self.membership.state_servers(prefer, self._admission.admits)
        state = self._catchup.download_state(candidates, timeout_s)
        # announce at once the round this peer trains in next: the others wait only for peers they
        # know of, and the periodic heartbeat could come a whole heartbeat_s after that round began
        self.membership.state, self.membership.step = ACTIVE, self.step
        self.membership.beat()
        return state


async def _node_identity(_dht, node):
    return node.peer_id, node.p2p.daemon_listen_maddr


async def _visible_maddrs(_dht, node):
    return await node.get_visible_maddrs()


async def _add_record_validator(_dht, node):
    node.protocol.record_validator.extend([SignedRecordValidator()])
