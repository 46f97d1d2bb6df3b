"""Catching up in the hivemind backend: state for joiners and for peers that fell out of sync.

``CatchUp`` is a mixin of ``HivemindBackend`` (round logs are in ``hivemind_adopt``). A joining peer
downloads a live peer's state, made by that peer's ``state_provider`` between two training steps
(under ``state_lock``) and sent in the safe format of ``hivemind_state`` (nothing received is
unpickled). A peer serves one snapshot at a time, only to admissible peers, and waits for the state
lock at most ``snapshot_lock_s`` (two rounds), so that requesters cannot pile up threads.
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
    @property
    def snapshot_lock_s(self) -> float:
        """How long a snapshot waits for ``state_lock``: a training step holds it for its compute and
        one round (at most ``step_timeout_s``); longer waits would only park threads for requesters."""
        return min(self.state_timeout_s, 2 * self.step_timeout_s)

    def _snapshot(self) -> bytes:
        if not self.state_lock.acquire(timeout=self.snapshot_lock_s):
            raise HivemindBackendError("training step held the state lock too long")
        try:
            # the provider first: one that flushes a pending round (DisTrOAdamW.state_dict() with
            # overlap) moves the step, and the state must be labelled with the step it is at
            state = self.state_provider()
            return dump_state({"step": self._low, "state": state})
        finally:
            self.state_lock.release()

    async def _on_state(self, info, reader, writer) -> None:
        try:
            magic = await asyncio.wait_for(reader.readexactly(len(wire.STATE_MAGIC)), 5)
            if (
                magic != wire.STATE_MAGIC
                or self.state_provider is None
                or self.out_of_sync
                or self._snapshot_busy  # one at a time: each holds a thread and a copy of the state
                or not self._admissible(info.peer_id.to_base58())
            ):
                writer.write(bytes([wire.MISSING]))
                return
            self._snapshot_busy = True
            try:
                blob = await asyncio.to_thread(self._snapshot)
            finally:
                self._snapshot_busy = False
            writer.write(bytes([wire.OK]))
            await asyncio.wait_for(wire.write_frame(writer, wire.U64, blob), self.state_timeout_s)
        except asyncio.CancelledError:
            pass  # the backend is closing: asyncio would print the cancellation as an error
        except Exception as exc:  # noqa: BLE001
            logger.debug("state request failed: %s", exc)
        finally:
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


def checked_state(tree) -> tuple[int, object]:
    """``(step, state)`` of a downloaded tree, or ``ValueError`` before anything of this peer changes."""
    if not isinstance(tree, dict) or "state" not in tree:
        raise ValueError("state blob has no 'state' entry")
    step = tree.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError("state has no valid step number")
    return step, tree["state"]
