"""Who is in a run, from DHT heartbeats, and the replica checksums peers compare through the DHT.

Every peer stores a record under the key ``"{run_id}.peers"`` with its peer id as subkey and a short
expiry (``ttl_s``), refreshed every ``heartbeat_s``: a crashed peer drops out of every view within
``ttl_s``; a peer that leaves cleanly overwrites its record with ``state="left"`` first.
Replica checksums live under ``"{run_id}.checksum.{step}"``, one subkey per peer. The view answers
the backend's questions about the others: are enough peers here to start, who can serve state, does
this peer's checksum agree with the majority's.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

ACTIVE, JOINING, LEFT = "active", "joining", "left"


@dataclass(frozen=True)
class PeerRecord:
    state: str
    client: bool
    step: int


class Membership:
    """Heartbeats of this peer and the latest view of the others, refreshed on a background thread."""

    def __init__(
        self,
        dht,
        run_id: str,
        peer_id: str,
        *,
        client: bool,
        heartbeat_s: float,
        ttl_s: float,
        dht_timeout_s: float,
    ):
        check_heartbeat(heartbeat_s, ttl_s)
        self.dht, self.run_id, self.peer_id, self.client = dht, run_id, peer_id, client
        self.heartbeat_s, self.ttl_s, self.dht_timeout_s = heartbeat_s, ttl_s, dht_timeout_s
        self.state = JOINING
        self.step = 0
        self._view: dict[str, PeerRecord] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"hm-membership-{run_id}", daemon=True)

    @property
    def key(self) -> str:
        return f"{self.run_id}.peers"

    def start(self) -> None:
        self.beat()
        self.refresh()
        self._thread.start()

    def view(self) -> dict[str, PeerRecord]:
        """The other peers whose latest record says active or joining (never this peer)."""
        with self._lock:
            return dict(self._view)

    def beat(self) -> None:
        record = {"state": self.state, "client": self.client, "step": int(self.step)}
        self._call(self.dht.store, self.key, record, get_dht_time() + self.ttl_s, subkey=self.peer_id)

    def refresh(self) -> None:
        found = self._call(self.dht.get, self.key, latest=True)
        view = {}
        if found is not None and isinstance(found.value, dict):
            for peer, item in found.value.items():
                record = _parse_record(getattr(item, "value", None))
                if peer != self.peer_id and record is not None and record.state != LEFT:
                    view[str(peer)] = record
        with self._lock:
            self._view = view

    def leave(self) -> None:
        """Announce a clean leave so that the others stop waiting for this peer at once."""
        self._stop.set()
        self.state = LEFT
        self.beat()
        if self._thread.is_alive():
            self._thread.join(timeout=self.dht_timeout_s + self.heartbeat_s)

    def wait_for_active(self, n: int, timeout_s: float) -> int:
        """Announce this peer active, then block until ``n`` other active peers are in the view (or
        ``timeout_s``); return how many are."""
        self.state = ACTIVE
        self.beat()
        deadline = time.monotonic() + timeout_s
        while True:
            self.refresh()
            count = sum(rec.state == ACTIVE for rec in self.view().values())
            if count >= n or time.monotonic() >= deadline:
                return count
            time.sleep(0.2)

    def state_servers(self, prefer, admits) -> list[str]:
        """The active server peers of a fresh view (only those of ``prefer``, if given) that
        ``admits(peer)`` accepts, the most advanced first: the peers to download state from."""
        self.refresh()
        view = self.view()
        candidates = [
            p
            for p in (prefer or view)
            if p in view and view[p].state == ACTIVE and not view[p].client and admits(p)
        ]
        candidates.sort(key=lambda p: -view[p].step)
        return candidates

    def publish_checksum(self, step: int, checksum: str) -> None:
        key = f"{self.run_id}.checksum.{int(step)}"
        self._call(self.dht.store, key, str(checksum), get_dht_time() + 10 * self.ttl_s, subkey=self.peer_id)

    def checksums(self, step: int) -> dict[str, str]:
        found = self._call(self.dht.get, f"{self.run_id}.checksum.{int(step)}", latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(p): v.value for p, v in found.value.items() if isinstance(getattr(v, "value", None), str)}

    def compare_checksum(self, step: int, checksum: str) -> list[str] | None:
        """``None`` when this peer's ``checksum`` agrees with the majority of the reports for ``step``
        (or there is none); else the majority's peers."""
        reports = self.checksums(step)
        reports[self.peer_id] = checksum
        value, holders = majority(reports)
        return None if value is None or value == checksum else holders

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.beat()
            self.refresh()

    def _call(self, fn, *args, **kwargs):
        # every DHT call is bounded: a stalled DHT must not stall training
        try:
            return fn(*args, return_future=True, **kwargs).result(timeout=self.dht_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat is retried on the next beat
            logger.warning("DHT %s failed: %s: %s", fn.__name__, type(exc).__name__, exc)
            return None


def check_heartbeat(heartbeat_s: float, ttl_s: float) -> None:
    """A record must be refreshed before it expires, or live peers would drop out of every view."""
    if not 0 < heartbeat_s < ttl_s:
        raise ValueError(f"Invalid heartbeat: heartbeat_s={heartbeat_s} must be > 0 and < ttl_s={ttl_s}")


def _parse_record(value) -> PeerRecord | None:
    # records come from strangers: anything malformed is ignored, not trusted
    if not isinstance(value, dict):
        return None
    state, client, step = value.get("state"), value.get("client"), value.get("step")
    if state not in (ACTIVE, JOINING, LEFT) or not isinstance(client, bool) or not isinstance(step, int):
        return None
    return PeerRecord(state, client, step)


def majority(checksums: dict[str, str]) -> tuple[str | None, list[str]]:
    """The checksum held by more than half of the reporting peers and who holds it, or (None, [])."""
    if not checksums:
        return None, []
    value, count = collections.Counter(checksums.values()).most_common(1)[0]
    if 2 * count <= len(checksums):
        return None, []
    return value, sorted(p for p, v in checksums.items() if v == value)
