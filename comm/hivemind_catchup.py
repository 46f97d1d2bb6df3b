"""Catching up in the hivemind backend: state for joiners and for peers that fell out of sync.

``CatchUp`` is a mixin of ``HivemindBackend`` (round logs are in ``hivemind_adopt``). A joining peer
downloads a live peer's state, made by that peer's ``state_provider`` between two training steps
(under ``state_lock``) and sent in the safe format of ``hivemind_state`` (nothing received is
unpickled). A peer serves state only to admissible peers and holds at most one snapshot at a time:
requesters that come while one is being made or sent share it (one copy of the state, one thread
waiting for the state lock, at most ``state_timeout_s``); a snapshot older than ``log_rounds // 2``
steps is not handed to new requesters, who wait (bounded) until its last requester is served.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import PeerID

from . import hivemind_wire as wire
from .hivemind_membership import ACTIVE
from .hivemind_state import dump_state, load_state

logger = logging.getLogger(__name__)


class HivemindBackendError(RuntimeError):
    """The hivemind backend could not do what was asked (start, download state, finish a round)."""


class CatchUp:
    """State download and serving (mixin)."""

    def load_state_from_peers(self, prefer=None, timeout_s: float | None = None):
        """Download a live peer's state (made by its ``state_provider``) and take its step number."""
        self.membership.refresh()
        view = self.membership.view()
        candidates = [
            p
            for p in (prefer or view)
            if p in view and view[p].state == ACTIVE and not view[p].client and self._admissible(p)
        ]
        candidates.sort(key=lambda p: -view[p].step)
        errors = []
        for peer in candidates:
            try:
                blob = self._call(self._fetch_state(peer), timeout_s or self.state_timeout_s)
                step, state = checked_state(load_state(blob))
            except Exception as exc:  # noqa: BLE001 - try the next peer
                errors.append(f"{peer[-8:]}: {type(exc).__name__}: {exc}")
                continue
            try:
                self._call(self._reset(step), 10)
            except Exception as exc:  # noqa: BLE001 - peer.py catches only HivemindBackendError
                raise HivemindBackendError(f"could not move to step {step}: {type(exc).__name__}") from exc
            self.out_of_sync = False
            return state
        raise HivemindBackendError(
            f"no peer of run {self.run_id!r} served its state ({'; '.join(errors) or 'none'})"
        )

    # ----- state ---------------------------------------------------------------------------
    def _snapshot(self) -> bytes:
        if not self.state_lock.acquire(timeout=self.state_timeout_s):
            raise HivemindBackendError("training step held the state lock too long")
        try:
            # the provider first: one that flushes a pending round (DisTrOAdamW.state_dict() with
            # overlap) moves the step, and the state must be labelled with the step it is at
            state = self.state_provider()
            return dump_state({"step": self._low, "state": state})
        finally:
            self.state_lock.release()

    async def _shared_snapshot(self, deadline: float) -> "_Snapshot | None":
        """The one snapshot this peer holds, made or being made, with one more user; ``None`` when an
        old one stays in use until ``deadline``. Requesters that come while one exists share it, so
        at most one copy of the state (and one thread waiting for ``state_lock``) exists at a time."""
        loop = asyncio.get_running_loop()
        while True:
            snap = self._snap
            if snap is not None and snap.blob.done() and (snap.blob.cancelled() or snap.blob.exception()):
                snap = self._snap = None  # a failed one (lock timeout): try again, not its error
            if snap is None:
                blob = asyncio.ensure_future(asyncio.to_thread(self._snapshot))
                blob.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, if nobody waits
                snap = self._snap = _Snapshot(blob, self._low)
                break
            if not snap.blob.done() or self._low - snap.step < max(1, self.log_rounds // 2):
                break  # still recent enough for a joiner to catch up from round logs
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(0.1)  # too old: a fresh one once its last requester is served
        snap.users += 1
        return snap

    def _release(self, snap: "_Snapshot") -> None:
        snap.users -= 1
        if snap.users == 0 and self._snap is snap:
            self._snap = None  # the blob goes with its last requester

    async def _on_state(self, info, reader, writer) -> None:
        snap = None
        try:
            magic = await asyncio.wait_for(reader.readexactly(len(wire.STATE_MAGIC)), 5)
            if (
                magic != wire.STATE_MAGIC
                or self.state_provider is None
                or self.out_of_sync
                or not self._admissible(info.peer_id.to_base58())
            ):
                writer.write(bytes([wire.MISSING]))
                return
            loop = asyncio.get_running_loop()
            snap = await self._shared_snapshot(loop.time() + self.state_timeout_s)
            try:
                # shield: a requester that goes away must not cancel the snapshot the others wait for
                blob = None if snap is None else await asyncio.shield(snap.blob)
            except Exception as exc:  # noqa: BLE001 - lock timeout or a failing provider
                logger.debug("state request: %s: %s", type(exc).__name__, exc)
                blob = None
            if blob is None:
                writer.write(bytes([wire.MISSING]))  # an explicit answer, not a dropped stream
                return
            writer.write(bytes([wire.OK]))
            await asyncio.wait_for(_send_blob(writer, blob), self.state_timeout_s)
        except asyncio.CancelledError:
            pass  # the backend is closing: asyncio would print the cancellation as an error
        except Exception as exc:  # noqa: BLE001
            logger.debug("state request failed: %s", exc)
        finally:
            if snap is not None:
                self._release(snap)
            writer.close()

    async def _fetch_state(self, peer: str) -> bytes:
        _, reader, writer = await self._p2p.call_binary_stream_handler(
            PeerID.from_base58(peer), f"distro/{self.run_id}/state"
        )
        try:
            writer.write(wire.STATE_MAGIC)
            if (await reader.readexactly(1))[0] != wire.OK:
                raise HivemindBackendError("peer does not serve state")
            return await wire.read_frame(reader, wire.U64, self.max_state_nbytes, "state")
        finally:
            writer.close()

    async def _reset(self, step: int) -> None:
        for r in self._rounds.values():
            for t in r.tasks:
                t.cancel()
        self._rounds.clear()
        self._finished.clear()
        self._log.clear()
        self._low = self._next = step


STATE_CHUNK_NBYTES = 1 << 20  # a state blob is written in pieces: each stream buffers at most one


async def _send_blob(writer, blob: bytes) -> None:
    """``U64`` length and ``blob``, one piece at a time, so that a requester that reads slowly (or
    never) makes the stream buffer one piece, not a copy of the whole state."""
    writer.write(wire.U64.pack(len(blob)))
    view = memoryview(blob)
    for i in range(0, len(blob), STATE_CHUNK_NBYTES):
        writer.write(view[i : i + STATE_CHUNK_NBYTES])
        await writer.drain()
    await writer.drain()


class _Snapshot:
    """A state blob being made or sent, with the number of requesters it is for."""

    def __init__(self, blob: asyncio.Future, step: int):
        self.blob, self.step, self.users = blob, step, 0


def checked_state(tree) -> tuple[int, object]:
    """``(step, state)`` of a downloaded tree, or ``ValueError`` before anything of this peer changes."""
    if not isinstance(tree, dict) or "state" not in tree:
        raise ValueError("state blob has no 'state' entry")
    step = tree.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError("state has no valid step number")
    return step, tree["state"]
