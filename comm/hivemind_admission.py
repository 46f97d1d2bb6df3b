"""Which peers the hivemind backend takes payloads from and serves: those on its allow list, if it has
one, and not excluded; and how many streams of one kind each may hold open (``StreamSlots``).

A peer is excluded for ``exclude_s`` when its payload had the wrong size, failed the program's
payload validator, or was reported invalid by the optimizer after the step.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class Admission:
    """The allow list (``None``: every peer) and the live exclusions of one backend."""

    def __init__(self, allow_peers, exclude_s: float):
        self.allow_peers = None if allow_peers is None else {str(p) for p in allow_peers}
        self.exclude_s = exclude_s
        self.excluded: dict[str, float] = {}  # peer id -> time.monotonic() at which its exclusion ends
        # report_invalid excludes from the training thread, bad streams from the event loop
        self._lock = threading.Lock()

    def allowed(self, peer: str) -> bool:
        """Whether the allow list (not the exclusions) lets ``peer`` in: a private run ignores every
        record and stream of the peers it does not list."""
        allow = self.allow_peers
        return allow is None or peer in allow

    def admits(self, peer: str) -> bool:
        if not self.allowed(peer):
            return False
        with self._lock:
            return self.excluded.get(peer, 0.0) <= time.monotonic()

    def exclude(self, peer: str, why: str) -> None:
        logger.warning("excluding peer %s for %.0f s: %s", peer, self.exclude_s, why)
        with self._lock:
            now = time.monotonic()
            for old in [p for p, until in self.excluded.items() if until <= now]:
                del self.excluded[old]  # strangers can mint identities: keep only live exclusions
            self.excluded[peer] = now + self.exclude_s


class StreamSlots:
    """How many streams of one kind each peer, and all peers together, may hold open at once: one
    peer cannot take every slot, and what a slot costs (a state snapshot in memory) stays bounded."""

    def __init__(self, per_peer: int, total: int):
        self.per_peer, self.total = per_peer, total
        self.held: dict[str, int] = {}  # touched on the event loop only

    def take(self, peer: str) -> bool:
        if self.held.get(peer, 0) >= self.per_peer or sum(self.held.values()) >= self.total:
            return False
        self.held[peer] = self.held.get(peer, 0) + 1
        return True

    def give(self, peer: str) -> None:
        self.held[peer] -= 1
        if not self.held[peer]:
            del self.held[peer]
