"""The membership view (hivemind_membership) when the DHT misbehaves: peers in one process, on 127.0.0.1."""

import concurrent.futures
import time

import pytest

pytest.importorskip("hivemind")

from hivemind.utils import get_dht_time  # noqa: E402


import _hm_local as local  # noqa: E402
group, gather, filled, firsts = local.group, local.gather, local.filled, local.firsts
pytestmark = pytest.mark.timeout(60)


dhts = local.dhts_fixture(3)


class FailingLookups:
    """A DHT whose ``get`` fails as one that runs past ``dht_timeout_s`` does; the rest is the real one."""

    def __init__(self, dht):
        self._dht = dht

    def __getattr__(self, name):
        return getattr(self._dht, name)

    def get(self, *args, **kwargs):
        future = concurrent.futures.Future()
        future.set_exception(TimeoutError("DHT get timed out"))
        return future


def test_a_failed_lookup_keeps_the_previous_view_and_the_round_expects_everyone(dhts):
    with group(dhts) as (a, b, c):
        before = sorted(a.membership.view())
        a.membership.dht = FailingLookups(a.membership.dht)
        a.membership.refresh()
        assert sorted(a.membership.view()) == before == sorted([b.peer_id, c.peer_id])
        results, _ = gather([(a, filled(1)), (b, filled(2)), (c, filled(3))])
        assert sorted(firsts(results[0])) == [1, 2, 3]


def test_records_kept_through_failed_lookups_still_leave_the_view_when_they_expire(dhts):
    with group(dhts, n=2) as (a, b):
        a.membership.dht = FailingLookups(a.membership.dht)
        b.membership.leave()  # b's record is no longer refreshed; a cannot look it up either
        time.sleep(1.5 + 0.3)  # ttl_s of the group, and one heartbeat
        assert a.membership.view() == {}


def test_checksums_under_made_up_peer_ids_do_not_make_a_majority(dhts):
    with group(dhts) as (a, b, c):
        gather([(a, filled(1)), (b, filled(2)), (c, filled(3))])
        for peer in (a, b, c):
            peer.publish_checksum(5, "good")
        for i in range(4):  # any DHT node can write any subkey: here one with no backend at all
            assert dhts[0].store(f"{a.run_id}.checksum.5", "forged", get_dht_time() + 30, subkey=f"sybil{i}")
        assert a.compare_checksum(5, "good") is None
