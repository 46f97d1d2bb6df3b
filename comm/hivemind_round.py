"""One step's gather over libp2p streams: the per-step state and the stream protocol of the hivemind backend.

``GatherStreams`` is a mixin of ``HivemindBackend`` (it uses the backend's event loop, p2p client,
exclusions and counters); ``hivemind_wire`` has the frame layout and the agreement rule.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from hivemind.p2p import PeerID

from . import hivemind_wire as wire

logger = logging.getLogger(__name__)

LOOKAHEAD_STEPS = 2  # how far ahead of us a peer's round may be before we refuse to buffer it


class Round:
    """What this peer knows about one step's gather; touched only on the backend's event loop."""

    def __init__(self, step: int):
        self.step = step
        self.own: bytes | None = None
        self.own_ready = asyncio.Event()
        self.phase1 = asyncio.Event()
        self.finished = asyncio.Event()
        self.changed = asyncio.Event()
        self.gather_deadline = self.vote_deadline = self.deadline = 0.0
        self.payloads: dict[str, bytes] = {}
        self.votes: dict[str, dict[str, str]] = {}
        self.vote_done: set[str] = set()
        self.no_payload: set[str] = set()  # peers whose payload will not come this round
        self.streams: set[str] = set()
        self.pushed: set[str] = set()
        self.push_over: set[str] = set()  # our pushes that delivered our payload or failed
        self.late: set[str] = set()
        self.my_vote = b""
        self.tasks: set[asyncio.Task] = set()

    def notify(self) -> None:
        self.changed.set()

    async def wait_until(self, cond, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        while not cond():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return cond()
        return True


class GatherStreams:
    """Pushing our payload, receiving the others', under the round's deadlines (mixin)."""

    def _round(self, step: int) -> Round:
        if step not in self._rounds:
            self._rounds[step] = Round(step)
        return self._rounds[step]

    def _is_late(self, step: int) -> bool:
        return step < self._low or step in self._finished

    def _admissible(self, peer: str) -> bool:
        if self.allow_peers is not None and peer not in self.allow_peers:
            return False
        with self._excluded_lock:
            return self._excluded.get(peer, 0.0) <= time.monotonic()

    def _exclude(self, peer: str, why: str) -> None:
        # the lock: report_invalid excludes from the training thread, bad streams from the event loop
        logger.warning("excluding peer %s for %.0f s: %s", peer, self.exclude_s, why)
        with self._excluded_lock:
            now = time.monotonic()
            for old in [p for p, until in self._excluded.items() if until <= now]:
                del self._excluded[old]  # strangers can mint identities: keep only live exclusions
            self._excluded[peer] = now + self.exclude_s

    def _valid(self, data: bytes) -> bool:
        try:
            return bool(self.payload_validator(torch.frombuffer(bytearray(data), dtype=torch.uint8)))
        except Exception as exc:  # noqa: BLE001 - a validator that raises means "invalid"
            logger.debug("payload validator raised %s: %s", type(exc).__name__, exc)
            return False

    def _count_sent(self, nbytes: int) -> None:
        self.stats.bytes_sent += nbytes  # only the event loop thread writes the counters

    def _count_received(self, nbytes: int) -> None:
        self.stats.bytes_received += nbytes

    def _answer(self, writer, status: int) -> None:
        """Write a gather stream's 1-byte status, counted like every other byte of the stream."""
        self._count_sent(1)
        writer.write(bytes([status]))

    def _spawn_push(self, r: Round, peer: str) -> None:
        r.pushed.add(peer)
        task = self._loop.create_task(self._push(r, peer))
        r.tasks.add(task)

    async def _push(self, r: Round, peer: str) -> None:
        writer = None
        try:
            remaining = max(0.01, r.gather_deadline - asyncio.get_running_loop().time())
            stream = self._p2p.call_binary_stream_handler(
                PeerID.from_base58(peer), f"distro/{self.run_id}/gather"
            )
            _, reader, writer = await asyncio.wait_for(stream, remaining)
            flags = wire.FLAG_REPLY if self.client_mode else 0
            writer.write(wire.HELLO.pack(wire.GATHER_MAGIC, wire.VERSION, flags, r.step, len(r.own)))
            self._count_sent(wire.HELLO.size)
            status = (await asyncio.wait_for(reader.readexactly(1), remaining))[0]
            self._count_received(1)
            if status != wire.OK:
                r.no_payload.add(peer)  # a LATE answer alone proves nothing: a stranger may lie
                if status == wire.LATE:
                    r.late.add(peer)
            elif not r.phase1.is_set():  # past our gather phase, our payload would only confuse it
                await self._exchange(r, peer, reader, writer, send=True, receive=self.client_mode)
        except Exception as exc:  # noqa: BLE001 - any failure of a stranger's stream only drops that peer
            logger.debug("push of step %d to %s failed: %s: %s", r.step, peer, type(exc).__name__, exc)
            r.no_payload.add(peer)  # it is unreachable or broke the protocol: do not wait for it
        finally:
            r.push_over.add(peer)
            r.notify()
            if writer is not None:
                writer.close()

    async def _exchange(self, r: Round, peer: str, reader, writer, *, send: bool, receive: bool) -> None:
        """Send our payload and vote and/or receive theirs on one stream, each under the round deadline."""

        async def send_ours():
            self._count_sent(wire.U64.size + len(r.own))
            await wire.write_frame(writer, wire.U64, r.own)
            r.push_over.add(peer)
            r.notify()
            await r.phase1.wait()
            if r.my_vote:  # empty when the round ended by adopting another peer's result
                self._count_sent(wire.U32.size + len(r.my_vote))
                await wire.write_frame(writer, wire.U32, r.my_vote)

        async def recv():
            try:
                (n,) = wire.U64.unpack(await reader.readexactly(wire.U64.size))
                self._count_received(wire.U64.size)
                if n != len(r.own):
                    self._exclude(peer, f"payload of {n} bytes where {len(r.own)} were expected")
                    return
                data = await reader.readexactly(n)
                self._count_received(n)
                if r.phase1.is_set():
                    return  # arrived after the gather phase: too late for this step
                if self.payload_validator is not None and not await asyncio.to_thread(self._valid, data):
                    self._exclude(peer, "its payload failed the payload validator")
                    return
                r.payloads[peer] = data
                r.notify()
                vote = await wire.read_frame(reader, wire.U32, wire.vote_limit(self.max_peers), "vote")
                self._count_received(wire.U32.size + len(vote))
                r.votes[peer] = wire.decode_vote(vote, r.step)
            finally:
                r.vote_done.add(peer)
                r.notify()

        loop = asyncio.get_running_loop()
        jobs = ([send_ours()] if send else []) + ([recv()] if receive else [])
        await asyncio.wait_for(asyncio.gather(*jobs), max(0.01, r.deadline - loop.time()))

    async def _on_gather(self, info, reader, writer) -> None:
        peer = info.peer_id.to_base58()
        task = asyncio.current_task()
        registered = None  # the round this stream speaks for, once it is the peer's only stream there
        try:
            hello = await asyncio.wait_for(reader.readexactly(wire.HELLO.size), self.step_timeout_s)
            self._count_received(wire.HELLO.size)
            magic, version, flags, step, nbytes = wire.HELLO.unpack(hello)
            if magic != wire.GATHER_MAGIC or version != wire.VERSION:
                return
            if not self._admissible(peer) or step > self._next + LOOKAHEAD_STEPS:
                self._answer(writer, wire.REJECTED)
                return
            if self._is_late(step):
                self._answer(writer, wire.LATE)
                return
            r = self._round(step)
            if peer in r.streams or len(r.streams) >= self.max_peers:
                self._answer(writer, wire.REJECTED)
                return
            r.streams.add(peer)
            registered = r
            r.tasks.add(task)
            # the expected size is this peer's own payload size: wait (bounded) until we have ours
            await asyncio.wait_for(r.own_ready.wait(), self.step_timeout_s)
            if nbytes != len(r.own):
                self._exclude(peer, f"announced a payload of {nbytes} bytes where {len(r.own)} were expected")
                self._answer(writer, wire.BAD_SIZE)
                return
            if r.phase1.is_set():
                self._answer(writer, wire.LATE)
                return
            self._answer(writer, wire.OK)
            reply = bool(flags & wire.FLAG_REPLY)
            if not reply and not self.client_mode and peer not in r.pushed:
                self._spawn_push(r, peer)  # a peer we did not know yet (just joined): answer it too
            await self._exchange(r, peer, reader, writer, send=reply, receive=True)
        except Exception as exc:  # noqa: BLE001 - a broken stream from a stranger only drops that stream
            logger.debug("gather stream from %s failed: %s: %s", peer, type(exc).__name__, exc)
        finally:
            if registered is not None:
                if peer not in registered.payloads:
                    registered.no_payload.add(peer)  # nothing more will come from it this round: stop waiting
                registered.vote_done.add(peer)
                registered.notify()
            writer.close()
