"""The gather streams of the hivemind backend: pushing this peer's payload and vote to the others,
receiving theirs, under one round's deadlines; every byte that crosses them is counted in ``stats``.

``hivemind_wire`` has the frame layout; ``hivemind_round`` the per-step state the streams fill in.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from . import hivemind_wire as wire
from .base import CommStats
from .hivemind_admission import Admission
from .hivemind_link import StreamLink
from .hivemind_round import Round, RoundBook
from .hivemind_settings import Settings

logger = logging.getLogger(__name__)

LOOKAHEAD_STEPS = 2  # how far ahead of us a peer's round may be before we refuse to buffer it


class GatherStreams:
    """One backend's side of every gather stream: the pushes it opens and the handler it serves."""

    def __init__(
        self, settings: Settings, book: RoundBook, admission: Admission, stats: CommStats, link: StreamLink
    ):
        self.settings, self.book, self.admission = settings, book, admission
        self.stats, self.link = stats, link
        # (uint8 tensor) -> bool, set by the program from the optimizer's codec: payloads that fail it
        # are dropped before the vote, so a garbage sender never counts in the agreement
        self.payload_validator = None

    def spawn_push(self, r: Round, peer: str) -> None:
        """Open a stream to ``peer`` and push our payload of round ``r`` on it, in the background."""
        r.pushed.add(peer)
        task = self.link.loop.create_task(self._push(r, peer))
        r.tasks.add(task)

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

    async def _push(self, r: Round, peer: str) -> None:
        writer = None
        try:
            remaining = max(0.01, r.gather_deadline - asyncio.get_running_loop().time())
            stream = self.link.open(peer, self.settings.protocol("gather"))
            _, reader, writer = await asyncio.wait_for(stream, remaining)
            flags = wire.FLAG_REPLY if self.settings.client_mode else 0
            writer.write(wire.HELLO.pack(wire.GATHER_MAGIC, wire.VERSION, flags, r.step, len(r.own)))
            self._count_sent(wire.HELLO.size)
            status = (await asyncio.wait_for(reader.readexactly(1), remaining))[0]
            self._count_received(1)
            if status != wire.OK:
                r.no_payload.add(peer)  # a LATE answer alone proves nothing: a stranger may lie
                if status == wire.LATE:
                    r.late.add(peer)
            elif not r.phase1.is_set():  # past our gather phase, our payload would only confuse it
                await self._exchange(r, peer, reader, writer, send=True, receive=self.settings.client_mode)
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
            if r.my_vote:  # empty when this peer abstained (it is behind this step)
                self._count_sent(wire.U32.size + len(r.my_vote))
                await wire.write_frame(writer, wire.U32, r.my_vote)

        async def recv():
            try:
                (n,) = wire.U64.unpack(await reader.readexactly(wire.U64.size))
                self._count_received(wire.U64.size)
                if n != len(r.own):
                    self.admission.exclude(peer, f"payload of {n} bytes where {len(r.own)} were expected")
                    return
                data = await reader.readexactly(n)
                self._count_received(n)
                if r.phase1.is_set():
                    return  # arrived after the gather phase: too late for this step
                if self.payload_validator is not None and not await asyncio.to_thread(self._valid, data):
                    self.admission.exclude(peer, "its payload failed the payload validator")
                    return
                r.payloads[peer] = data
                r.notify()
                limit = wire.vote_limit(self.settings.max_peers)
                vote = await wire.read_frame(reader, wire.U32, limit, "vote")
                self._count_received(wire.U32.size + len(vote))
                r.votes[peer] = wire.decode_vote(vote, r.step)
            finally:
                r.vote_done.add(peer)
                r.notify()

        loop = asyncio.get_running_loop()
        jobs = ([send_ours()] if send else []) + ([recv()] if receive else [])
        await asyncio.wait_for(asyncio.gather(*jobs), max(0.01, r.deadline - loop.time()))

    async def on_gather(self, info, reader, writer) -> None:
        """The handler of a gather stream another peer opened to us."""
        peer = info.peer_id.to_base58()
        task = asyncio.current_task()
        registered = None  # the round this stream speaks for, once it is the peer's only stream there
        try:
            hello = await asyncio.wait_for(reader.readexactly(wire.HELLO.size), self.settings.step_timeout_s)
            self._count_received(wire.HELLO.size)
            magic, version, flags, step, nbytes = wire.HELLO.unpack(hello)
            if magic != wire.GATHER_MAGIC or version != wire.VERSION:
                return
            if self.book.left or not self.admission.admits(peer) or step > self.book.next + LOOKAHEAD_STEPS:
                self._answer(writer, wire.REJECTED)
                return
            if self.book.is_late(step):
                self._answer(writer, wire.LATE)
                return
            r = self.book.round(step)
            if peer in r.streams or len(r.streams) >= self.settings.max_peers:
                self._answer(writer, wire.REJECTED)
                return
            r.streams.add(peer)
            registered = r
            r.tasks.add(task)
            if flags & wire.FLAG_REPLY:
                r.clients.add(peer)
            # the expected size is this peer's own payload size: wait (bounded) until we have ours
            await asyncio.wait_for(r.own_ready.wait(), self.settings.step_timeout_s)
            if r.own is None:  # this peer left the run instead of starting the round
                self._answer(writer, wire.REJECTED)
                return
            if nbytes != len(r.own):
                self.admission.exclude(
                    peer, f"announced a payload of {nbytes} bytes where {len(r.own)} were expected"
                )
                self._answer(writer, wire.BAD_SIZE)
                return
            if r.phase1.is_set():
                self._answer(writer, wire.LATE)
                return
            self._answer(writer, wire.OK)
            reply = bool(flags & wire.FLAG_REPLY)
            if not reply and not self.settings.client_mode and peer not in r.pushed:
                self.spawn_push(r, peer)  # a peer we did not know yet (just joined): answer it too
            await self._exchange(r, peer, reader, writer, send=reply, receive=True)
        except Exception as exc:  # noqa: BLE001 - a broken stream from a stranger only drops that stream
            logger.debug("gather stream from %s failed: %s: %s", peer, type(exc).__name__, exc)
        except asyncio.CancelledError:  # the backend closes: end quietly (asyncio would log a traceback)
            logger.debug("gather stream from %s cancelled: the backend closes", peer)
        finally:
            if registered is not None:
                if peer not in registered.payloads:
                    registered.no_payload.add(peer)  # nothing more will come from it this round: stop waiting
                registered.vote_done.add(peer)
                registered.notify()
            writer.close()
