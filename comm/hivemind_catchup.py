"""Catching up in the hivemind backend: round logs for peers that fell behind, state for joiners.

A peer keeps the contributors and payloads of its last ``log_rounds`` rounds (in its ``RoundBook``);
a peer that finds a round already finished (or that another voter saw more than it did) fetches that
round from it. A joining peer downloads a live peer's state, made by that peer's ``state_provider``
between two training steps (under ``state_lock``) and sent in the safe format of ``hivemind_state``
(nothing received is unpickled).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from . import hivemind_wire as wire
from .hivemind_link import StreamLink
from .hivemind_round import Round, RoundBook
from .hivemind_settings import Settings
from .hivemind_state import dump_state, load_state

logger = logging.getLogger(__name__)


class HivemindBackendError(RuntimeError):
    """The hivemind backend could not do what was asked (start, download state, finish a round)."""


class CatchUp:
    """One backend's round logs and state, served to other peers and fetched from them."""

    def __init__(self, settings: Settings, book: RoundBook, link: StreamLink, state_lock: threading.RLock):
        self.settings, self.book, self.link = settings, book, link
        self.state_lock = state_lock  # the training thread holds it around a step: snapshots are whole
        self.state_provider = None  # () -> tree of tensors, served to joining peers

    def download_state(self, candidates: list[str], timeout_s: float | None):
        """The state of the first of ``candidates`` that serves one; this peer takes its step number."""
        errors = []
        for peer in candidates:
            try:
                blob = self.link.call(self._fetch_state(peer), timeout_s or self.settings.state_timeout_s)
                tree = load_state(blob)
                step = tree.get("step") if isinstance(tree, dict) else None
                if not isinstance(step, int) or step < 0:
                    raise ValueError("state has no valid step number")
            except Exception as exc:  # noqa: BLE001 - try the next peer
                errors.append(f"{peer[-8:]}: {type(exc).__name__}: {exc}")
                continue
            self.link.call(self._reset(step), 10)
            self.book.out_of_sync = False
            return tree["state"]
        raise HivemindBackendError(
            f"no peer of run {self.settings.run_id!r} served its state ({'; '.join(errors) or 'none'})"
        )

    async def adopt(self, r: Round, peers: list[str]) -> list[tuple[str, bytes]] | None:
        """The contributors (and payloads) another peer applied for this round, from its log."""
        loop = asyncio.get_running_loop()
        for peer in peers:
            remaining = r.deadline - loop.time()
            if remaining <= 0:
                break
            try:
                return await asyncio.wait_for(self._fetch_log(peer, r.step, len(r.own)), remaining)
            except Exception as exc:  # noqa: BLE001 - ask the next peer
                logger.debug("log of step %d from %s failed: %s: %s", r.step, peer, type(exc).__name__, exc)
        return None

    async def _fetch_log(self, peer: str, step: int, nbytes: int) -> list[tuple[str, bytes]]:
        max_peers = self.settings.max_peers
        _, reader, writer = await self.link.open(peer, self.settings.protocol("log"))
        try:
            writer.write(wire.LOG_REQUEST.pack(wire.LOG_MAGIC, step))
            if (await reader.readexactly(1))[0] != wire.OK:
                raise HivemindBackendError(f"peer has no log of step {step}")
            header = await wire.read_frame(reader, wire.U32, wire.MAX_LOG_ENTRY_NBYTES * max_peers, "log")
            peers = wire.decode_log(header, step)
            if not peers or len(peers) > max_peers:
                raise HivemindBackendError("log has no or too many contributors")
            out = [(p, await reader.readexactly(nbytes)) for p in sorted(peers)]
            if any(wire.digest(p, b) != peers[p] for p, b in out):
                raise HivemindBackendError("log payload does not match its digest")
            return out
        finally:
            writer.close()

    async def on_log(self, info, reader, writer) -> None:
        """The handler of a log stream: a peer asks what this one applied at a step."""
        try:
            magic, step = wire.LOG_REQUEST.unpack(
                await asyncio.wait_for(reader.readexactly(wire.LOG_REQUEST.size), 5)
            )
            r = self.book.rounds.get(step)
            if magic == wire.LOG_MAGIC and r is not None and r.own_ready.is_set():
                await asyncio.wait_for(r.finished.wait(), self.settings.step_timeout_s)
            entries = self.book.log.get(step) if magic == wire.LOG_MAGIC else None
            if not entries:
                writer.write(bytes([wire.MISSING]))
                return
            writer.write(bytes([wire.OK]))
            await wire.write_frame(
                writer, wire.U32, wire.encode_log(step, {p: wire.digest(p, b) for p, b in entries})
            )
            for _, b in entries:
                writer.write(b)
            await asyncio.wait_for(writer.drain(), self.settings.step_timeout_s)
        except Exception as exc:  # noqa: BLE001
            logger.debug("log request failed: %s", exc)
        finally:
            writer.close()

    def _snapshot(self) -> bytes:
        if not self.state_lock.acquire(timeout=self.settings.state_timeout_s):
            raise HivemindBackendError("training step held the state lock too long")
        try:
            return dump_state({"step": self.book.low, "state": self.state_provider()})
        finally:
            self.state_lock.release()

    async def on_state(self, info, reader, writer) -> None:
        """The handler of a state stream: a joining peer asks for this one's state."""
        try:
            magic = await asyncio.wait_for(reader.readexactly(len(wire.STATE_MAGIC)), 5)
            if magic != wire.STATE_MAGIC or self.state_provider is None or self.book.out_of_sync:
                writer.write(bytes([wire.MISSING]))
                return
            blob = await asyncio.to_thread(self._snapshot)
            writer.write(bytes([wire.OK]))
            await asyncio.wait_for(wire.write_frame(writer, wire.U64, blob), self.settings.state_timeout_s)
        except Exception as exc:  # noqa: BLE001
            logger.debug("state request failed: %s", exc)
        finally:
            writer.close()

    async def _fetch_state(self, peer: str) -> bytes:
        _, reader, writer = await self.link.open(peer, self.settings.protocol("state"))
        try:
            writer.write(wire.STATE_MAGIC)
            if (await reader.readexactly(1))[0] != wire.OK:
                raise HivemindBackendError("peer does not serve state")
            return await wire.read_frame(reader, wire.U64, self.settings.max_state_nbytes, "state")
        finally:
            writer.close()

    async def _reset(self, step: int) -> None:
        self.book.reset(step)  # on the event loop, which owns the rounds
