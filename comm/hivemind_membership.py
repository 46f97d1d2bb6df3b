"""Who is in a run, from signed DHT heartbeats, and the replica checksums peers compare through the DHT.

Every peer stores a record under the key ``"{run_id}.peers"`` with a short expiry (``ttl_s``),
refreshed every ``heartbeat_s``: a crashed peer drops out of every view within ``ttl_s``; a peer
that leaves cleanly overwrites its record with ``state="left"`` first. Replica checksums live under
``"{run_id}.checksum.{step}"``. Every record is signed by the peer it names (``hivemind_records``):
nobody can remove a peer from a view, announce it, or report a checksum in its name. A lookup that
fails keeps the last view (each record until its own expiry), so one lost DHT answer does not make
the next round run alone. Records of the peers ``allowed`` refuses (outside a private run's allow
list) count nowhere: not in the view, the departures, the state servers or the checksums. The view
answers the backend's questions about the others: are enough peers here to start, who can serve
state, is this peer's checksum the one the replicas should hold (``replica_choice``).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from .hivemind_records import RecordSigner, key_id, subkey_of, verify

logger = logging.getLogger(__name__)

ACTIVE, JOINING, LEFT = "active", "joining", "left"
FAILED = object()  # what ``Membership._call`` returns when the DHT did not answer


@dataclass(frozen=True)
class PeerRecord:
    state: str
    client: bool
    step: int
    in_sync: bool = True  # False while the peer is out of sync: state is fetched from others first
    expires: float = float("inf")  # DHT time after which the record no longer counts


class Membership:
    """Signed heartbeats of this peer and the latest view of the others, refreshed on a background thread."""

    def __init__(
        self,
        dht,
        run_id: str,
        signer: RecordSigner,
        *,
        client: bool,
        heartbeat_s: float,
        ttl_s: float,
        dht_timeout_s: float,
        in_sync=lambda: True,
        allowed=lambda peer: True,
    ):
        check_heartbeat(heartbeat_s, ttl_s)
        self.dht, self.run_id, self.signer, self.client = dht, run_id, signer, client
        self.peer_id = signer.peer_id
        self.heartbeat_s, self.ttl_s, self.dht_timeout_s = heartbeat_s, ttl_s, dht_timeout_s
        self.in_sync = in_sync  # () -> bool, announced in every heartbeat
        # (peer) -> bool: the records of peers it refuses (a private run's strangers) count nowhere
        self.allowed = allowed
        self.state = JOINING
        self.step = 0
        self._view: dict[str, PeerRecord] = {}
        self._left: set[str] = set()  # the peers whose latest record announced a clean leave
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
        """The other peers whose latest unexpired record says active or joining (never this peer)."""
        now = get_dht_time()
        with self._lock:
            return {p: rec for p, rec in self._view.items() if rec.expires > now}

    def beat(self) -> None:
        record = {"state": self.state, "client": self.client, "step": int(self.step)}
        record["in_sync"] = self.in_sync()
        self._store(self.key, json.dumps(record).encode(), get_dht_time() + self.ttl_s)

    def refresh(self) -> None:
        records = self._signed(self.key)
        if records is FAILED:
            return  # keep the last view: its records still expire on their own
        view, left = {}, set()
        for peer, (body, expires) in records.items():
            record = _parse_record(body, expires)
            if peer == self.peer_id or record is None or not self.allowed(peer):
                continue
            if record.state == LEFT:
                left.add(peer)
            else:
                view[peer] = record
        with self._lock:
            self._view, self._left = view, left

    def has_left(self, peer: str) -> bool:
        """Whether ``peer``'s latest record (as of the last lookup that answered) announced a clean leave."""
        with self._lock:
            return peer in self._left

    def leave(self) -> None:
        """Announce a clean leave so that the others stop waiting for this peer at once."""
        self._stop.set()
        self.state = LEFT
        self.beat()
        if self._thread.is_alive():
            self._thread.join(timeout=self.dht_timeout_s + self.heartbeat_s)

    def wait_for_active(self, n: int, timeout_s: float) -> int:
        """Announce this peer active, then block until ``n`` other active peers are in the view (or
        ``timeout_s``, or this peer leaves); return how many are."""
        if not self._stop.is_set():  # a peer that left announces nothing more
            self.state = ACTIVE
            self.beat()
        deadline = time.monotonic() + timeout_s
        while True:
            self.refresh()
            count = sum(rec.state == ACTIVE for rec in self.view().values())
            if count >= n or time.monotonic() >= deadline or self._stop.wait(0.2):
                return count

    def state_servers(self, prefer, admits) -> list[str]:
        """The active server peers of a fresh view (only those of ``prefer``, if given) that
        ``admits(peer)`` accepts, those in sync first, then the most advanced: the peers to
        download state from."""
        self.refresh()
        view = self.view()
        candidates = [
            p
            for p in (prefer or view)
            if p in view and view[p].state == ACTIVE and not view[p].client and admits(p)
        ]
        candidates.sort(key=lambda p: (not view[p].in_sync, -view[p].step))
        return candidates

    def publish_checksum(self, step: int, checksum: str) -> None:
        key = f"{self.run_id}.checksum.{int(step)}"
        self._store(key, str(checksum).encode(), get_dht_time() + 10 * self.ttl_s)

    def checksums(self, step: int) -> dict[str, str]:
        """The checksums the peers ``allowed`` reported after ``step``, each signed by its peer."""
        records = self._signed(f"{self.run_id}.checksum.{int(step)}")
        if records is FAILED:
            return {}
        out = {}
        for peer, (body, _) in records.items():
            if not self.allowed(peer):
                continue
            try:
                out[peer] = body.decode("ascii")
            except UnicodeDecodeError:
                continue
        return out

    def compare_checksum(self, step: int, checksum: str, admits=lambda peer: True) -> list[str] | None:
        """``None`` when this peer's ``checksum`` for ``step`` is the one every replica should hold
        (``replica_choice`` over the reports of the peers ``admits`` accepts, this peer's included),
        or when no report picks one (then differing reports are logged as a warning); else the peers
        that hold the chosen checksum, to reload state from."""
        reports = {p: c for p, c in self.checksums(step).items() if admits(p)}
        reports[self.peer_id] = checksum
        others = sum(admits(p) for p in self.view())
        value, holders = replica_choice(reports, run_size=others + 1)
        if value is None and len(set(reports.values())) > 1:
            # nobody reloads, so the replicas stay apart: say so, the program has no other sign of it
            logger.warning(
                "step %d: the replica checksums of %d peers differ and none is held by more peers than "
                "every other, by two or more; no peer reloads state", step, len(reports),
            )
        return None if value is None or value == checksum else holders

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.beat()
            self.refresh()

    def _store(self, key: str, body: bytes, expiration: float) -> None:
        value = self.signer.sign(key, body, expiration)
        self._call(self.dht.store, key, value, expiration, subkey=subkey_of(self.peer_id))

    def _signed(self, key: str):
        """``{peer: (body, expiration)}`` of the records under ``key`` that their peer signed, or
        ``FAILED`` when the DHT did not answer."""
        found = self._call(self.dht.get, key, latest=True)
        if found is FAILED:
            return FAILED
        records = {}
        if found is not None and isinstance(found.value, dict):
            kid = key_id(key)
            for subkey, item in found.value.items():
                value, expires = getattr(item, "value", None), getattr(item, "expiration_time", None)
                body = verify(kid, subkey, value, expires) if isinstance(expires, float) else None
                if body is not None:
                    records[subkey.split(":", 1)[1]] = (body, expires)
        return records

    def _call(self, fn, *args, **kwargs):
        # every DHT call is bounded: a stalled DHT must not stall training
        try:
            return fn(*args, return_future=True, **kwargs).result(timeout=self.dht_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat is retried on the next beat
            logger.warning("DHT %s failed: %s: %s", fn.__name__, type(exc).__name__, exc)
            return FAILED


def check_heartbeat(heartbeat_s: float, ttl_s: float) -> None:
    """A record must be refreshed before it expires, or live peers would drop out of every view."""
    if not 0 < heartbeat_s < ttl_s:
        raise ValueError(f"Invalid heartbeat: heartbeat_s={heartbeat_s} must be > 0 and < ttl_s={ttl_s}")


def _parse_record(body: bytes, expires: float) -> PeerRecord | None:
    # a signed record still comes from a stranger: anything malformed is ignored, not trusted
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    state, client, step, in_sync = (value.get(k) for k in ("state", "client", "step", "in_sync"))
    if state not in (ACTIVE, JOINING, LEFT) or not isinstance(client, bool) or not isinstance(step, int):
        return None
    return PeerRecord(state, client, step, in_sync is not False, expires)


def majority(checksums: dict[str, str]) -> tuple[str | None, list[str]]:
    """The checksum held by more than half of the reporting peers and who holds it, or (None, [])."""
    if not checksums:
        return None, []
    value, count = collections.Counter(checksums.values()).most_common(1)[0]
    if 2 * count <= len(checksums):
        return None, []
    return value, sorted(p for p, v in checksums.items() if v == value)


def replica_choice(checksums: dict[str, str], run_size: int) -> tuple[str | None, list[str]]:
    """The checksum every replica should hold after a comparison, and who holds it, or (None, []).

    ``checksums``: each reporting peer's checksum; ``run_size``: how many peers the reader's view
    holds, itself included. The checksum held by the most peers, if two or more hold it, or if the
    run is two peers and both report; between checksums held by equally many, the lowest. Every
    peer that reads the same reports picks the same one, so a split heals at the next comparison:
    a strict majority as before, and also a 2-2 or 1-1 tie, which used to leave the replicas apart.

    One rogue among honest peers cannot take the run this way: a checksum held by two or more
    peers is held by an honest one, and the download that follows takes only the state the holders
    vouch for together (``CatchUp.download_state``); a checksum held by one peer is chosen only in
    a run of two, where a rogue would be half of the peers (no rule can tell an honest peer from a
    rogue then, and this backend assumes an honest majority), never because the other reports of a
    larger run are missing from a lookup. With three or more reports that differ everywhere (a
    rogue beside a split of two) nothing is chosen.
    """
    if not checksums:
        return None, []
    counts = collections.Counter(checksums.values())
    most = max(counts.values())
    if most < 2 and not len(checksums) == run_size == 2:
        return None, []
    value = min(v for v, n in counts.items() if n == most)
    return value, sorted(p for p, v in checksums.items() if v == value)
