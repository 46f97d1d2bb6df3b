"""Adopting another peer's result for a round (hivemind_adopt): peers in one process, all on 127.0.0.1.

Late peers apply what the finished peers applied; a log is checked before it is applied; two peers that
each think the other better informed neither deadlock nor silently apply different sets.
"""


import asyncio
import time

import pytest

pytest.importorskip("hivemind")

from hivemind.p2p import PeerID  # noqa: E402

from distro_opt.comm import hivemind_wire as wire  # noqa: E402
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
    """Votes an invented digest, then serves a log that gives every contributor its bytes (99s)
    ("reattribute"), or its honest set plus a payload of a peer nobody else heard of ("extra")."""

    forge = "reattribute"
    forged_ids: list = []

    def _round(self, step):
        if step not in self._rounds:
            self._rounds[step] = InventedDigestRound(step)
        return self._rounds[step]

    def _finish(self, r, result):
        out = super()._finish(r, result)
        if self.forge == "extra":
            self._log[r.step] = sorted([*result, ("12D3KooWmadeup", bytes(filled(99)))])
        else:
            self._log[r.step] = [(p, bytes(filled(99))) for p in sorted(self.forged_ids)]
        return out


@pytest.mark.parametrize("forge", ["reattribute", "extra"])
def test_a_voter_inventing_a_digest_cannot_make_peers_apply_its_forged_log(dhts, forge):
    class Forger(ForgingPeer):
        pass

    Forger.forge = forge
    with group(dhts, classes={2: Forger}) as (a, b, r):
        Forger.forged_ids = [a.peer_id, b.peer_id, r.peer_id]
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
        # a and b apply different agreements ({a}, {b}): both flag. x and y each wait for the wider
        # a (b), whose flagged round serves no log: they flag too, instead of applying a's set silently
        assert [p.out_of_sync for p in peers] == [True] * 4, [p.last_contributors for p in peers]
        assert a.last_contributors == [a.peer_id] and b.last_contributors == [b.peer_id]


class LateLiar(HivemindBackend):
    """Joins an open run normally (active heartbeat, nothing forged) but contributes nothing: it answers
    LATE to every gather stream and serves round logs of its own making. ``mode``: "subset" serves each
    requester a log of only the requester's own payload (got through a REPLY stream), "missing" serves
    none, "self" serves a log of only its own (valid) payload, and is silent in step 0."""

    mode = "subset"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stolen = {}

    async def _on_gather(self, info, reader, writer):
        try:
            hello = await asyncio.wait_for(reader.readexactly(wire.HELLO.size), 5)
            step = wire.HELLO.unpack(hello)[3]
            quiet = self.mode == "self" and step == 0
            writer.write(bytes([wire.REJECTED if quiet else wire.LATE]))  # "finished without you"
        finally:
            writer.close()

    async def _push(self, r, peer):  # a REPLY stream: the peer sends us its payload
        writer = None
        try:
            _, reader, writer = await self._p2p.call_binary_stream_handler(
                PeerID.from_base58(peer), f"distro/{self.run_id}/gather"
            )
            hello = wire.HELLO.pack(wire.GATHER_MAGIC, wire.VERSION, wire.FLAG_REPLY, r.step, len(r.own))
            writer.write(hello)
            if (await reader.readexactly(1))[0] == wire.OK:
                (n,) = wire.U64.unpack(await reader.readexactly(wire.U64.size))
                self.stolen[(r.step, peer)] = await reader.readexactly(n)
        except Exception:  # noqa: BLE001
            pass
        finally:
            r.no_payload.add(peer)
            r.push_over.add(peer)
            r.notify()
            if writer is not None:
                writer.close()

    async def _on_log(self, info, reader, writer):
        try:
            magic, step = wire.LOG_REQUEST.unpack(await reader.readexactly(wire.LOG_REQUEST.size))
            who = info.peer_id.to_base58()
            if self.mode == "self":
                data, who = bytes(filled(9)), self.peer_id
            else:
                for _ in range(25):  # until the requester's payload came on our REPLY stream (0.5 s)
                    if (step, who) in self.stolen or self.mode == "missing":
                        break
                    await asyncio.sleep(0.02)
                data = self.stolen.get((step, who))
            if self.mode == "missing" or data is None:
                writer.write(bytes([wire.MISSING]))
                return
            writer.write(bytes([wire.OK]))
            await wire.write_frame(writer, wire.U32, wire.encode_log(step, {who: wire.digest(who, data)}))
            if magic == wire.LOG_MAGIC:
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


@pytest.mark.parametrize("mode", ["subset", "missing", "self"])
def test_a_peer_that_answers_late_but_never_contributed_cannot_end_the_honest_peers_round(dhts, mode):
    # a LATE answer alone proves nothing: the honest peers vote as usual and all apply {a, b, c}
    class Liar(LateLiar):
        pass

    Liar.mode = mode
    with group(dhts, n=4, classes={3: Liar}) as (a, b, c, s):
        for step in range(2):
            pairs = [(a, filled(1)), (b, filled(2)), (c, filled(3))]
            results, _ = gather(pairs + ([(s, filled(9))] if mode != "self" else []))
            assert [sorted(firsts(x)) for x in results[:3]] == [[1, 2, 3]] * 3, step
            assert not (a.out_of_sync or b.out_of_sync or c.out_of_sync), step


class FrozenLogs(HivemindBackend):
    """A contributor that stops answering after a round (lid closed, process stopped, host gone)."""

    frozen = False

    async def _on_log(self, info, reader, writer):
        if self.frozen:
            await asyncio.sleep(60)  # close() cancels it
        return await super()._on_log(info, reader, writer)


@pytest.mark.parametrize("case", ["left", "client", "crash", "frozen"])
def test_a_late_peer_applies_the_finished_set_when_a_contributor_cannot_vouch(dhts, case):
    options = {1: {"client_mode": True}} if case == "client" else None
    with group(dhts, options=options, classes={0: FrozenLogs, 1: FrozenLogs}) as (a, b, c):
        gather([(a, filled(1)), (b, filled(2))])  # c is slow: a and b finish step 0
        if case == "left":
            b.close()
        elif case == "crash":
            b._call(b._shutdown(), 10)  # its handlers are gone, no goodbye in the DHT (like SIGKILL)
        elif case == "frozen":  # the one c asks first (peers in id order)
            min(a, b, key=lambda x: x.peer_id).frozen = True
        (late,), (took,) = gather([(c, filled(3))])
        assert sorted(firsts(late)) == [1, 2] and not c.out_of_sync
        assert took < STEP_TIMEOUT_S / 2  # a frozen contributor has 0.1 * step_timeout_s to vouch


class HeadersOnly(HivemindBackend):
    """Answers header requests (it vouches for its payload) but serves no full log."""

    async def _on_log(self, info, reader, writer):
        try:
            magic, step = wire.LOG_REQUEST.unpack(await reader.readexactly(wire.LOG_REQUEST.size))
            status, entries, digests = await self._log_answer(step)
            if magic != wire.LOG_HEAD_MAGIC or status != wire.OK:
                writer.write(bytes([wire.MISSING]))
                return
            writer.write(bytes([status]))
            await wire.write_frame(writer, wire.U32, wire.encode_log(step, digests))
        finally:
            writer.close()


class LogForger(HivemindBackend):
    """After each round, serves a log whose entry for another contributor is forged: either its
    digest and bytes ("digest"), or only its bytes under the honest digest ("bytes")."""

    forge = "digest"

    def _finish(self, r, result):
        out = super()._finish(r, result)
        honest = {p: wire.digest(p, b) for p, b in result}
        forged = [(p, b if p == self.peer_id else bytes(filled(99))) for p, b in result]
        self._log[r.step] = forged
        if self.forge == "bytes":
            self._log_heads[r.step] = (forged, honest)
        return out


@pytest.mark.parametrize("forge", ["digest", "bytes"])
def test_a_late_peer_refuses_a_log_that_its_senders_refute_or_whose_bytes_miss_their_digest(dhts, forge):
    class Forger(LogForger):
        pass

    Forger.forge = forge
    with group(dhts, classes={0: Forger, 1: HeadersOnly}) as (a, b, c):
        gather([(a, filled(1)), (b, filled(2))])
        (late,), _ = gather([(c, filled(3))])
        assert firsts(late) == [] and c.out_of_sync  # never a's 99s; b serves no full log


def test_a_peer_late_for_only_some_peers_applies_the_set_the_others_applied(dhts):
    # c enters after a's gather deadline (a answers LATE) but before b's (b takes c's payload): c
    # must not give up on a's PROVISIONAL answer and reload state; every peer applies one set
    t = 3.0  # gather deadline: 1.5 s after a peer enters the round
    with group(dhts, options={i: {"step_timeout_s": t} for i in range(3)}) as (a, b, c):
        results, _ = local.gather_at([(a, filled(1), 0.0), (b, filled(2), 0.6), (c, filled(3), 1.8)])
        assert len({tuple(p.last_contributors) for p in (a, b, c)}) == 1, [firsts(x) for x in results]
        assert not (a.out_of_sync or b.out_of_sync or c.out_of_sync)


class SlowLinks(HivemindBackend):
    """Payloads from the peers in ``slow_from`` never arrive in time (their stream is refused)."""

    async def _on_gather(self, info, reader, writer):
        if info.peer_id.to_base58() in self.slow_from:
            await asyncio.sleep(0.5)  # the pusher waits for it: every other payload arrives meanwhile
            writer.write(bytes([wire.REJECTED]))
            writer.close()
            return
        return await super()._on_gather(info, reader, writer)


def test_a_peer_waits_for_a_wider_voter_that_is_still_adopting_instead_of_applying_its_own_set(dhts):
    # held: p0 {0,1,2,3}  p1 {0,1,3}  p2 {0,2,3}  p3 {2,3}. p2 adopts p0's set; p3 asks p2 while p2 is
    # still adopting (PROVISIONAL {2,3}, equal to p3's own agreement) and must wait for p2's final set
    classes = {i: type(f"SlowLinks{i}", (SlowLinks,), {"slow_from": set()}) for i in range(4)}
    with group(dhts, n=4, classes=classes) as ps:
        ids = [p.peer_id for p in ps]
        ps[1].slow_from, ps[2].slow_from, ps[3].slow_from = {ids[2]}, {ids[1]}, {ids[0], ids[1]}
        gather([(p, filled(i)) for i, p in enumerate(ps)])
        unflagged = {tuple(p.last_contributors) for p in ps if not p.out_of_sync}
        assert len(unflagged) <= 1, [(p.last_contributors, p.out_of_sync) for p in ps]
        outcome = [([ids.index(q) for q in p.last_contributors], p.out_of_sync) for p in ps]
        assert not ps[3].out_of_sync and ps[3].last_contributors == ps[2].last_contributors, outcome


def test_adopted_payloads_are_validated_together_within_the_step_deadline(dhts):
    with group(dhts, n=4, options={3: {"step_timeout_s": 1.0}}) as (*done, late):
        gather([(p, filled(i + 1)) for i, p in enumerate(done)])  # the late peer is slow
        late.payload_validator = lambda buf: (time.sleep(0.8), True)[1]  # 2 threads: 1.6 s > 1.0 s
        (res,), (took,) = gather([(late, filled(9))])
        assert took < 1.0 + 0.4  # one after another they took 2.4 s
        assert res == [] and late.out_of_sync  # not validated in time: refused, flagged


class StillAdopting(HivemindBackend):
    """Answers log requests PROVISIONAL (as if still adopting) until ``until``."""

    until = 0.0

    async def _log_answer(self, step):
        status, entries, digests = await super()._log_answer(step)
        if status == wire.OK and time.monotonic() < self.until:
            return wire.PROVISIONAL, entries, digests
        return status, entries, digests


def test_a_late_peer_asks_again_while_the_finished_peers_still_adopt(dhts):
    with group(dhts, classes={0: StillAdopting, 1: StillAdopting}) as (a, b, c):
        gather([(a, filled(1)), (b, filled(2))])
        a.until = b.until = time.monotonic() + 0.3
        (late,), (took,) = gather([(c, filled(3))])
        assert sorted(firsts(late)) == [1, 2] and not c.out_of_sync  # it did not give up at once
        assert took < STEP_TIMEOUT_S / 2
