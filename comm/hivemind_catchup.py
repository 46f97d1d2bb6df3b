"""Catching up in the hivemind backend: the state a joining (or out-of-sync) peer downloads.

A live peer serves its state, made by its ``state_provider`` between two training steps (under
``state_lock``) and sent in the safe format of ``hivemind_state`` (nothing received is unpickled).
Only peers that ``Admission`` admits are served, one stream per peer and ``MAX_STATE_STREAMS`` in
all, and snapshots are made on a thread of their own, so that state requests never hold up the
threads that validate payloads. The bytes of state streams are counted in ``stats``, a
``CommStats`` apart from the gather streams' (its ``steps`` counts the downloads).

A download is verified, never taken on one peer's word (``download_state``): every candidate is
asked for its step and the digest of its state (``state_digest``, which the program sets to cover
what all replicas share: the model, not each worker's own optimizer state); the (step, digest)
that more than half of the answering peers report is the one taken, from one of those peers, and
only if what arrives has that step and that digest. With no such majority nothing is loaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading

from . import hivemind_wire as wire
from .base import CommStats
from .hivemind_admission import Admission, StreamSlots
from .hivemind_link import StreamLink
from .hivemind_membership import majority
from .hivemind_round import RoundBook
from .hivemind_settings import Settings
from .hivemind_state import dump_state, load_state

logger = logging.getLogger(__name__)

MAX_STATE_STREAMS = 2  # each snapshot holds a copy of the whole state in memory while it is sent
DOWNLOAD_ATTEMPTS = 3  # peers a step apart split the digests: ask again, a little later
DIGEST_TIMEOUT_S = 10.0


def whole_state_digest(state) -> str:
    """The default ``state_digest``: every byte of the state (for states every replica holds alike)."""
    return hashlib.sha256(dump_state(state)).hexdigest()


class HivemindBackendError(RuntimeError):
    """The hivemind backend could not do what was asked (start, download state, finish a round)."""


class CatchUp:
    """One backend's state, served to other peers and fetched from them."""

    def __init__(
        self, settings: Settings, book: RoundBook, admission: Admission, link: StreamLink,
        state_lock: threading.RLock,
    ):
        self.settings, self.book, self.admission, self.link = settings, book, admission, link
        self.state_lock = state_lock  # the training thread holds it around a step: snapshots are whole
        self.state_provider = None  # () -> tree of tensors, served to joining peers
        self.state_digest = whole_state_digest  # (tree) -> str: what the peers' replicas must agree on
        self.stats = CommStats()  # bytes of state streams, both ways; steps: the states downloaded
        self._slots = StreamSlots(per_peer=1, total=MAX_STATE_STREAMS)
        self._snapshots = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hm-state-snapshot")

    def download_state(self, candidates: list[str], timeout_s: float | None):
        """The state that more than half of the ``candidates`` that answer report (their step and
        ``state_digest``), downloaded from one of them and checked against both; this peer takes its
        step number. ``HivemindBackendError`` if no state has such a majority, or none arrives intact."""
        timeout_s = timeout_s or self.settings.state_timeout_s
        errors = []
        for attempt in range(DOWNLOAD_ATTEMPTS):
            if attempt:
                self.link.call(asyncio.sleep(0.2 * attempt), 5)
            answers = self.link.call(self._ask_digests(candidates), DIGEST_TIMEOUT_S + 5)
            value, holders = majority({p: f"{step}:{d}" for p, (step, d) in answers.items()})
            if value is None:
                errors.append(f"{len(answers)} of {len(candidates)} peers described their state and no "
                              "state had a majority" if answers else "no peer described its state")
                continue
            step = int(value.split(":", 1)[0])
            for peer in (p for p in candidates if p in holders):
                try:
                    state = self._fetch_verified(peer, step, answers[peer][1], timeout_s)
                except concurrent.futures.CancelledError:
                    raise HivemindBackendError("the backend was closed during a state download") from None
                except Exception as exc:  # noqa: BLE001 - try the next peer of the majority
                    errors.append(f"{peer[-8:]}: {type(exc).__name__}: {exc}")
                    continue
                self.link.call(self._reset(step), 10)
                self.book.out_of_sync = False
                self.stats.record(0, 0)
                return state
        raise HivemindBackendError(
            f"no peer of run {self.settings.run_id!r} served a state that a majority vouches for "
            f"({'; '.join(dict.fromkeys(errors)) or 'none'})"
        )

    def _fetch_verified(self, peer: str, step: int, digest: str, timeout_s: float):
        blob = self.link.call(self._fetch_state(peer, step), timeout_s)
        tree = load_state(blob)
        if not isinstance(tree, dict) or "state" not in tree:
            raise ValueError("state has no 'state' entry")
        if tree.get("step") != step or isinstance(tree.get("step"), bool):
            raise ValueError(f"state is not the one of step {step} it described")
        if self.state_digest(tree["state"]) != digest:
            raise ValueError("state does not match the digest the majority reported")
        return tree["state"]

    async def _ask_digests(self, candidates: list[str]) -> dict[str, tuple[int, str]]:
        """``{peer: (step, digest)}`` of the candidates that answered in time."""

        async def ask(peer):
            try:
                return peer, await asyncio.wait_for(self._fetch_digest(peer), DIGEST_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a peer that does not answer is not counted
                logger.debug("state digest of %s: %s: %s", peer, type(exc).__name__, exc)
                return peer, None

        answers = await asyncio.gather(*(ask(p) for p in candidates))
        return {p: a for p, a in answers if a is not None}

    def _snapshot(self, step: int | None = None) -> bytes | None:
        """The state as a blob, between two steps; None if ``step`` is given and it is not the step."""
        if not self.state_lock.acquire(timeout=self.settings.state_timeout_s):
            raise HivemindBackendError("training step held the state lock too long")
        try:
            if step is not None and step != self.book.low:
                return None
            return dump_state({"step": self.book.low, "state": self.state_provider()})
        finally:
            self.state_lock.release()

    def _describe(self) -> tuple[int, str]:
        """(step, ``state_digest`` of the state), between two steps."""
        if not self.state_lock.acquire(timeout=self.settings.state_timeout_s):
            raise HivemindBackendError("training step held the state lock too long")
        try:
            return self.book.low, self.state_digest(self.state_provider())
        finally:
            self.state_lock.release()

    async def on_state(self, info, reader, writer) -> None:
        """The handler of a state stream: a joining peer asks for this one's state, or its digest."""
        peer = info.peer_id.to_base58()
        slot = False
        try:
            magic = await asyncio.wait_for(reader.readexactly(len(wire.STATE_MAGIC)), 5)
            self.stats.bytes_received += len(magic)
            step = None
            if magic == wire.STATE_AT_MAGIC:
                (step,) = wire.U64.unpack(await asyncio.wait_for(reader.readexactly(wire.U64.size), 5))
                self.stats.bytes_received += wire.U64.size
            known = magic in (wire.STATE_MAGIC, wire.STATE_AT_MAGIC, wire.DIGEST_MAGIC)
            slot = self.admission.admits(peer) and self._slots.take(peer)
            if not known or self.state_provider is None or not slot:
                self._answer(writer, wire.MISSING)
                return
            loop = asyncio.get_running_loop()
            if magic == wire.DIGEST_MAGIC:
                low, digest = await loop.run_in_executor(self._snapshots, self._describe)
                data = str(digest).encode()[: wire.MAX_STATE_DIGEST_NBYTES]
                self._answer(writer, wire.OK)
                writer.write(wire.U64.pack(low))
                self.stats.bytes_sent += wire.U64.size + wire.U32.size + len(data)
                await asyncio.wait_for(wire.write_frame(writer, wire.U32, data), 5)
                await asyncio.wait_for(reader.read(1), 5)  # the asker closes once it has read it
                return
            blob = await loop.run_in_executor(self._snapshots, self._snapshot, step)
            if blob is None:  # trained on since it described its state: the asker tries another
                self._answer(writer, wire.MISSING)
                return
            self._answer(writer, wire.OK)
            self.stats.bytes_sent += wire.U64.size + len(blob)  # counted as written, like the gather streams
            await asyncio.wait_for(wire.write_frame(writer, wire.U64, blob), self.settings.state_timeout_s)
            # the asker closes once it holds the whole frame; closing first could cut the frame off in
            # the daemons' pipes, so wait (bounded) for its end of the stream
            await asyncio.wait_for(reader.read(1), self.settings.state_timeout_s)
        except Exception as exc:  # noqa: BLE001
            logger.debug("state request from %s failed: %s: %s", peer, type(exc).__name__, exc)
        except asyncio.CancelledError:  # the backend closes: end quietly (asyncio would log a traceback)
            logger.debug("state request from %s cancelled: the backend closes", peer)
        finally:
            if slot:
                self._slots.give(peer)
            writer.close()

    def _answer(self, writer, status: int) -> None:
        self.stats.bytes_sent += 1
        writer.write(bytes([status]))

    async def _fetch_state(self, peer: str, step: int | None = None) -> bytes:
        request = wire.STATE_MAGIC if step is None else wire.STATE_AT_MAGIC + wire.U64.pack(step)
        reader, writer = await self._request(peer, request)
        try:
            blob = await wire.read_frame(reader, wire.U64, self.settings.max_state_nbytes, "state")
            self.stats.bytes_received += wire.U64.size + len(blob)
            return blob
        finally:
            writer.close()

    async def _fetch_digest(self, peer: str) -> tuple[int, str]:
        reader, writer = await self._request(peer, wire.DIGEST_MAGIC)
        try:
            (step,) = wire.U64.unpack(await reader.readexactly(wire.U64.size))
            data = await wire.read_frame(reader, wire.U32, wire.MAX_STATE_DIGEST_NBYTES, "state digest")
            self.stats.bytes_received += wire.U64.size + wire.U32.size + len(data)
            return step, data.decode("ascii")
        finally:
            writer.close()

    async def _request(self, peer: str, request: bytes):
        """Open a state stream to ``peer``, send ``request`` and read an OK status: (reader, writer)."""
        _, reader, writer = await self.link.open(peer, self.settings.protocol("state"))
        try:
            writer.write(request)
            self.stats.bytes_sent += len(request)
            status = (await reader.readexactly(1))[0]
            self.stats.bytes_received += 1
            if status != wire.OK:
                raise HivemindBackendError("peer does not serve state")
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def _reset(self, step: int) -> None:
        self.book.reset(step)  # on the event loop, which owns the rounds

    def close(self) -> None:
        self._snapshots.shutdown(wait=False, cancel_futures=True)
