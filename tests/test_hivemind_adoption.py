"""Adopting another peer's result for a round (hivemind_adopt): peers in one process, all on 127.0.0.1.

Late peers apply what the finished peers applied; a log is checked before it is applied; two peers that
each think the other better informed neither deadlock nor silently apply different sets.
"""


import pytest

pytest.importorskip("hivemind")

from distro_opt.comm.hivemind_backend import HivemindBackend  # noqa: E402
from distro_opt.comm.hivemind_round import Round  # noqa: E402


import _hm_local as local  # noqa: E402
STEP_TIMEOUT_S = local.STEP_TIMEOUT_S
group, wait_all, gather = local.group, local.wait_all, local.gather
filled, firsts = local.filled, local.firsts
pytestmark = pytest.mark.timeout(60)


dhts = local.dhts_fixture(4)


def test_two_late_peers_apply_the_set_the_finished_peer_applied(dhts):
    with group(dhts) as (a, b, c):
        gather([(a, filled(1))])  # a finishes step 0 alone: b and c are slow
        results, _ = gather([(b, filled(2)), (c, filled(3))])
        assert [firsts(r) for r in results] == [[1], [1]]
        assert b.last_contributors == c.last_contributors == a.last_contributors == [a.peer_id]
        assert not b.out_of_sync and not c.out_of_sync


def test_a_late_peer_refuses_a_log_whose_payload_fails_its_validator(dhts):
    with group(dhts) as (a, b, c):
        gather([(a, filled(1)), (b, filled(2))])
        c.payload_validator = lambda buf: int(buf[0]) != 2  # b's payload is garbage to c
        (late,), _ = gather([(c, filled(3))])
        assert firsts(late) == []  # no log passes: nothing is applied unchecked
        assert c.out_of_sync


def test_a_late_peer_refuses_a_log_naming_a_peer_it_excluded(dhts):
    with group(dhts) as (a, b, c):
        gather([(a, filled(1)), (b, filled(2))])
        c.report_invalid(b.peer_id)
        (late,), _ = gather([(c, filled(3))])
        assert firsts(late) == [] and c.out_of_sync


def test_log_downloads_are_counted_by_the_server_and_the_requester(dhts):
    with group(dhts, wait=False) as (a, b, c):
        wait_all([a, b], 1)  # c is not active yet, so a and b open no gather stream to it
        gather([(a, filled(1)), (b, filled(2))])
        c.membership.refresh()
        before = [(x.stats.bytes_sent, x.stats.bytes_received) for x in (a, b, c)]
        (late,), _ = gather([(c, filled(3))])
        (a_sent, a_recv), (b_sent, b_recv), (c_sent, c_recv) = [
            (x.stats.bytes_sent - s, x.stats.bytes_received - r) for x, (s, r) in zip((a, b, c), before)
        ]
        assert sorted(firsts(late)) == [1, 2]
        assert c_recv >= 2 * 1000  # both payloads came through a log
        assert c_recv == a_sent + b_sent and c_sent == a_recv + b_recv


class InventedDigestRound(Round):
    """A round whose vote also lists a digest of a payload nobody has."""

    @property
    def my_vote(self):
        return self._vote

    @my_vote.setter
    def my_vote(self, vote):
        self._vote = vote + (b"\xee" * 8 if vote else b"")


class ForgingPeer(HivemindBackend):
    """Votes an invented digest, then serves a log that gives every contributor its bytes (99s)."""

    forged_ids: list = []

    def _round(self, step):
        if step not in self._rounds:
            self._rounds[step] = InventedDigestRound(step)
        return self._rounds[step]

    def _finish(self, r, result):
        out = super()._finish(r, result)
        self._log[r.step] = [(p, bytes(filled(99))) for p in sorted(self.forged_ids)]
        return out


def test_a_voter_inventing_a_digest_cannot_make_peers_apply_its_forged_log(dhts):
    with group(dhts, classes={2: ForgingPeer}) as (a, b, r):
        ForgingPeer.forged_ids = [a.peer_id, b.peer_id, r.peer_id]
        results, _ = gather([(a, filled(1)), (b, filled(2)), (r, filled(3))])
        assert [sorted(firsts(x)) for x in results[:2]] == [[1, 2, 3], [1, 2, 3]]
        assert a.out_of_sync and b.out_of_sync  # the voter's log did not check out: they resync


def test_peers_that_each_see_the_other_better_informed_finish_at_once_and_flag_differing_sets(dhts):
    # partial reachability: a and b reach each other; x reaches only a, y only b. a holds x's payload
    # that b lacks and b holds y's that a lacks, so each thinks the other better informed
    with group(dhts, n=4, wait=False) as (a, b, x, y):
        ids = {name: peer.peer_id for name, peer in zip("abxy", (a, b, x, y))}
        a.allow_peers, b.allow_peers = {ids[n] for n in "abx"}, {ids[n] for n in "aby"}
        x.allow_peers, y.allow_peers = {ids[n] for n in "ax"}, {ids[n] for n in "by"}
        local.wait_all_visible([a, b, x, y])
        peers = (a, b, x, y)
        _, times = gather([(p, filled(10 + i)) for i, p in enumerate(peers)])
        assert max(times) < STEP_TIMEOUT_S - 0.5  # nobody waited for the deadline
        # the peers that did not flag themselves out of sync all applied one set
        in_sync = {tuple(p.last_contributors) for p in peers if not p.out_of_sync}
        assert len(in_sync) <= 1, [(len(p.last_contributors), p.out_of_sync) for p in peers]
