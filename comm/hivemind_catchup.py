"""Catching up in the hivemind backend: the state a joining (or out-of-sync) peer downloads.

A live peer serves its state, made by its ``state_provider`` between two training steps (under
``state_lock``) and sent in the safe format of ``hivemind_state`` (nothing received is unpickled).
Only peers that ``Admission`` admits are served, one stream per peer and ``MAX_STATE_STREAMS`` in
all, and snapshots are made on a thread of their own, so that state requests never hold up the
threads that validate payloads. The bytes of state streams are counted in ``stats``, a
``CommStats`` apart from the gather streams' (its ``steps`` counts the downloads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

from . import hivemind_wire as wire
from .base import CommStats
from .hivemind_admission import Admission, StreamSlots
from .hivemind_link import StreamLink
from .hivemind_round import RoundBook
from .hivemind_settings import Settings
from .hivemind_state import dump_state, load_state

logger = logging.getLogger(__name__)

MAX_STATE_STREAMS = 2  # each snapshot holds a copy of the whole state in memory while it is sent


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
        self.stats = CommStats()  # bytes of state streams, both ways; steps: the states downloaded
        self._slots = StreamSlots(per_peer=1, total=MAX_STATE_STREAMS)
        self._snapshots = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hm-state-snapshot")

    def download_state(self, candidates: list[str], timeout_s: float | None):
        """The state of the first of ``candidates`` that serves one; this peer takes its step number."""
        errors = []
        for peer in candidates:
            try:
                blob = self.link.call(self._fetch_state(peer), timeout_s or self.settings.state_timeout_s)
                tree = load_state(blob)
                if not isinstance(tree, dict) or "state" not in tree:
                    raise ValueError("state has no 'state' entry")
                step = tree.get("step")
                if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                    raise ValueError("state has no valid step number")
            except concurrent.futures.CancelledError:
                raise HivemindBackendError("the backend was closed during a state download") from None
            except Exception as exc:  # noqa: BLE001 - try the next peer
                errors.append(f"{peer[-8:]}: {type(exc).__name__}: {exc}")
                continue
            self.link.call(self._reset(step), 10)
            self.book.out_of_sync = False
            self.stats.record(0, 0)
            return tree["state"]
        raise HivemindBackendError(
            f"no peer of run {self.settings.run_id!r} served its state ({'; '.join(errors) or 'none'})"
        )

    def _snapshot(self) -> bytes:
        if not self.state_lock.acquire(timeout=self.settings.state_timeout_s):
            raise HivemindBackendError("training step held the state lock too long")
        try:
            return dump_state({"step": self.book.low, "state": self.state_provider()})
        finally:
            self.state_lock.release()

    async def on_state(self, info, reader, writer) -> None:
        """The handler of a state stream: a joining peer asks for this one's state."""
        peer = info.peer_id.to_base58()
        slot = False
        try:
            magic = await asyncio.wait_for(reader.readexactly(len(wire.STATE_MAGIC)), 5)
            self.stats.bytes_received += len(magic)
            slot = self.admission.admits(peer) and self._slots.take(peer)
            if magic != wire.STATE_MAGIC or self.state_provider is None or not slot:
                self._answer(writer, wire.MISSING)
                return
            loop = asyncio.get_running_loop()
            blob = await loop.run_in_executor(self._snapshots, self._snapshot)
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

    async def _fetch_state(self, peer: str) -> bytes:
        _, reader, writer = await self.link.open(peer, self.settings.protocol("state"))
        try:
            writer.write(wire.STATE_MAGIC)
            self.stats.bytes_sent += len(wire.STATE_MAGIC)
            status = (await reader.readexactly(1))[0]
            self.stats.bytes_received += 1
            if status != wire.OK:
                raise HivemindBackendError("peer does not serve state")
            blob = await wire.read_frame(reader, wire.U64, self.settings.max_state_nbytes, "state")
            self.stats.bytes_received += wire.U64.size + len(blob)
            return blob
        finally:
            writer.close()

    async def _reset(self, step: int) -> None:
        self.book.reset(step)  # on the event loop, which owns the rounds

    def close(self) -> None:
        self._snapshots.shutdown(wait=False, cancel_futures=True)
