"""HivemindBackend with raw buffers: peers in one process, each with its own DHT, all on 127.0.0.1."""

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import uuid

import pytest
import torch

hivemind = pytest.importorskip("hivemind")

from hivemind.p2p import PeerID  # noqa: E402

from distro_opt.comm import hivemind_backend, hivemind_wire as wire  # noqa: E402
from distro_opt.comm.hivemind_backend import HivemindBackend, HivemindBackendError, dht_options  # noqa: E402

import _hm_local as local  # noqa: E402

LOOPBACK, STEP_TIMEOUT_S = local.LOOPBACK, local.STEP_TIMEOUT_S
group, wait_all, gather = local.group, local.wait_all, local.gather
filled, firsts = local.filled, local.firsts
pytestmark = pytest.mark.timeout(60)
dhts = local.dhts_fixture(3)


def test_all_gather_returns_every_peers_buffer_sorted_by_peer_id(dhts):
    with group(dhts, step_timeout_s=local.ROOMY_STEP_TIMEOUT_S) as bs:
        results, _ = gather([(b, filled(10 + i)) for i, b in enumerate(bs)])
        order = sorted(range(3), key=lambda i: bs[i].peer_id)
        assert [firsts(r) for r in results] == [[10 + i for i in order]] * 3
        assert [b.world_size for b in bs] == [3, 3, 3]


def test_bytes_counted_are_the_bytes_that_crossed_the_streams(dhts):
    with group(dhts, n=2) as (a, b):
        gather([(a, filled(1)), (b, filled(2))])
        vote = wire.encode_vote(
            0, [wire.digest(a.peer_id, bytes(filled(1))), wire.digest(b.peer_id, bytes(filled(2)))]
        )
        # our stream to b: hello, payload frame, vote; b's stream to us: the 1-byte status we answer
        expected = wire.HELLO.size + wire.U64.size + 1000 + wire.U32.size + len(vote) + 1
        assert a.stats.bytes_sent == b.stats.bytes_received == expected
        assert b.stats.bytes_sent == a.stats.bytes_received == expected
        assert a.stats.steps == b.stats.steps == 1


def test_client_mode_peer_exchanges_payloads_without_accepting_streams(dhts):
    with group(dhts, options={2: {"client_mode": True}}, step_timeout_s=local.ROOMY_STEP_TIMEOUT_S) as bs:
        results, _ = gather([(b, filled(10 + i)) for i, b in enumerate(bs)])
        assert [sorted(firsts(r)) for r in results] == [[10, 11, 12]] * 3


def test_a_second_client_mode_peer_refuses_to_train_and_the_run_goes_on_without_it(dhts):
    # two client-mode peers never reach each other: training both would split the replicas for good
    with group(dhts, n=2, options={1: {"client_mode": True}}, step_timeout_s=local.ROOMY_STEP_TIMEOUT_S) as (a, b):
        results, _ = gather([(a, filled(1)), (b, filled(2))])
        assert [sorted(firsts(r)) for r in results] == [[1, 2]] * 2
        c = HivemindBackend(a.run_id, dht=dhts[2], client_mode=True, heartbeat_s=0.3, ttl_s=1.5)
        try:
            local.wait_all_visible([a, b, c])
            with pytest.raises(HivemindBackendError, match=f"client-mode peer {b.peer_id} is already"):
                c.start_all_gather(filled(3))
        finally:
            c.close()
        deadline = time.monotonic() + 20
        while not (a.membership.has_left(c.peer_id) and b.membership.has_left(c.peer_id)):
            assert time.monotonic() < deadline, "the refusing peer's leave never arrived"
            time.sleep(0.1)
        results, _ = gather([(a, filled(1)), (b, filled(2))])
        assert [sorted(firsts(r)) for r in results] == [[1, 2]] * 2 and not b.out_of_sync


def test_peer_that_misses_the_deadline_is_left_out_and_the_step_stays_bounded(dhts):
    with group(dhts) as (a, b, c):
        results, times = gather([(a, filled(1)), (b, filled(2))])
        assert [sorted(firsts(r)) for r in results] == [[1, 2], [1, 2]]
        assert max(times) < STEP_TIMEOUT_S + 0.5
        assert a.world_size == 2


def test_late_peer_applies_nothing_and_is_out_of_sync_until_it_loads_state(dhts):
    with group(dhts) as (a, b, c):
        a.state_provider = lambda: {"w": torch.ones(2)}
        gather([(a, filled(1)), (b, filled(2))])
        (late,), _ = gather([(c, filled(3))])
        assert late == [] and c.step == 1 and c.out_of_sync  # step 0 finished without it
        c.load_state_from_peers(prefer=[a.peer_id])
        assert c.step == a.step and not c.out_of_sync


def test_a_peer_told_late_by_one_of_two_others_abstains_so_the_other_two_stay_identical(dhts):
    # a does not wait for c (as for a joiner it has not seen yet) and is past its gather phase when
    # c pushes, so it answers LATE; b still waits for c and takes its payload. Had c gone on, it
    # would vote out a's payload at b: a applies a+b, b only b, c b+c, and no checksum majority heals
    with group(dhts, step_timeout_s=local.ROOMY_STEP_TIMEOUT_S) as (a, b, c):
        expected = a._runner._expected
        a._runner._expected = lambda: {p: rec for p, rec in expected().items() if p != c.peer_id}
        results = {}

        def run(name, backend, value):
            results[name] = backend.all_gather(filled(value))

        threads = [threading.Thread(target=run, args=a_b, daemon=True) for a_b in (("a", a, 1), ("b", b, 2))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + local.ROOMY_STEP_TIMEOUT_S
        while not (0 in a._book.rounds and a._book.rounds[0].phase1.is_set()) and "a" not in results:
            assert time.monotonic() < deadline, "a never finished its gather phase"
            time.sleep(0.01)
        run("c", c, 3)
        for t in threads:
            t.join(2 * local.ROOMY_STEP_TIMEOUT_S)
        assert sorted(firsts(results["a"])) == sorted(firsts(results["b"])) == [1, 2]
        assert results["c"] == [] and c.out_of_sync and not (a.out_of_sync or b.out_of_sync)


def raw_gather_stream(sender, receiver):
    """A gather stream opened by hand from ``sender``'s p2p client to ``receiver`` (for misbehaving)."""
    return sender._link.p2p.call_binary_stream_handler(
        PeerID.from_base58(receiver.peer_id), f"distro/{receiver.run_id}/gather"
    )


def test_wrong_size_payload_is_refused_and_its_sender_excluded(dhts):
    with group(dhts, n=2) as (a, b):
        outcome = {}

        async def announce_wrong_size():
            _, reader, writer = await raw_gather_stream(b, a)
            writer.write(wire.HELLO.pack(wire.GATHER_MAGIC, wire.VERSION, 0, 0, 999))
            outcome["status"] = (await reader.readexactly(1))[0]
            writer.close()

        thread = threading.Thread(
            target=lambda: outcome.update(result=gather([(a, filled(1))])[0][0]), daemon=True
        )
        thread.start()
        b._link.call(announce_wrong_size(), 10)
        thread.join(3 * STEP_TIMEOUT_S)
        assert outcome["status"] == wire.BAD_SIZE
        assert b.peer_id in a._admission.excluded
        assert firsts(outcome["result"]) == [1]


def test_peers_with_different_payload_sizes_never_mix(dhts):
    with group(dhts) as bs:
        results, _ = gather([(bs[0], filled(1)), (bs[1], filled(2)), (bs[2], filled(3, n=999))])
        assert [sorted(firsts(r)) for r in results[:2]] == [[1, 2], [1, 2]]


def test_oversized_frame_is_refused_without_being_read(dhts):
    with group(dhts, n=2) as (a, b):
        outcome = {}

        async def flood():
            _, reader, writer = await raw_gather_stream(b, a)
            writer.write(wire.HELLO.pack(wire.GATHER_MAGIC, wire.VERSION, 0, 0, 1000))
            outcome["status"] = (await reader.readexactly(1))[0]
            writer.write(wire.U64.pack(1 << 30))
            try:
                for _ in range(256):  # up to 16 MiB
                    writer.write(bytes(1 << 16))
                    await asyncio.wait_for(writer.drain(), 5)
                outcome["end"] = "accepted"
            except Exception as exc:  # noqa: BLE001
                outcome["end"] = type(exc).__name__
            writer.close()

        thread = threading.Thread(target=lambda: gather([(a, filled(1))]), daemon=True)
        thread.start()
        b._link.call(flood(), 30)
        thread.join(3 * STEP_TIMEOUT_S)
        assert outcome["status"] == wire.OK
        assert outcome["end"] != "accepted"
        assert b.peer_id in a._admission.excluded
        assert a.stats.bytes_received < 1 << 16


def test_report_invalid_excludes_the_sender_from_the_next_steps(dhts):
    with group(dhts, n=2) as (a, b):
        gather([(a, filled(1)), (b, filled(2))])
        a.report_invalid(a.last_contributors.index(b.peer_id))
        results, _ = gather([(a, filled(1)), (b, filled(2))])
        assert firsts(results[0]) == [1]


def test_payload_validator_drops_an_invalid_payload_before_the_vote(dhts):
    with group(dhts) as bs:
        for b in bs:
            b.payload_validator = lambda buf: int(buf[0]) != 66
        results, _ = gather([(bs[0], filled(1)), (bs[1], filled(2)), (bs[2], filled(66))])
        assert [sorted(firsts(r)) for r in results[:2]] == [[1, 2], [1, 2]]


def test_allow_list_leaves_out_peers_not_on_it(dhts):
    with group(dhts, wait=False) as bs:
        allowed = [bs[0].peer_id, bs[1].peer_id]
        for b in bs[:2]:
            b.allow_peers = set(allowed)
        wait_all(bs, [1, 1, 2])  # a private peer counts no stranger; the stranger sees both
        results, _ = gather([(b, filled(10 + i)) for i, b in enumerate(bs)])
        assert [sorted(firsts(r)) for r in results[:2]] == [[10, 11], [10, 11]]


def test_joining_peer_downloads_state_and_step_number(dhts):
    with group(dhts, n=2) as (a, b):
        weights = {"w": torch.randn(3, 4), "step": torch.tensor(7)}
        a.state_provider = lambda: {"model": weights, "note": "hello"}
        gather([(a, filled(1)), (b, filled(2))])
        state = b.load_state_from_peers(prefer=[a.peer_id])
        assert torch.equal(state["model"]["w"], weights["w"]) and state["note"] == "hello"
        assert b.step == a.step == 1


def test_a_joiner_that_loaded_state_and_was_seen_trains_in_the_next_step_with_everyone(dhts):
    with group(dhts, wait=False) as (a, b, joiner):
        a.state_provider = lambda: {"w": torch.ones(1)}
        wait_all([a, b], 1)
        gather([(a, filled(1)), (b, filled(2))])
        joiner.load_state_from_peers(prefer=[a.peer_id])
        local.wait_all_visible([a, b, joiner])  # the event the others wait for, not a delay
        results, _ = gather([(a, filled(1)), (b, filled(2)), (joiner, filled(3))])
        assert [sorted(firsts(r)) for r in results] == [[1, 2, 3]] * 3
        assert a.step == b.step == joiner.step == 2 and not joiner.out_of_sync


def test_checksum_minority_learns_the_majority_peers(dhts):
    with group(dhts) as (a, b, c):
        for peer, value in ((a, "good"), (b, "good"), (c, "bad")):
            peer.publish_checksum(5, value)
        assert a.compare_checksum(5, "good") is None
        assert c.compare_checksum(5, "bad") == sorted([a.peer_id, b.peer_id])


def test_a_run_of_two_whose_replicas_split_reloads_the_higher_checksum(dhts):
    # no majority can form between two peers: the lower checksum is chosen, so exactly one reloads
    with group(dhts, n=2) as (a, b):
        a.publish_checksum(3, "one")
        b.publish_checksum(3, "other")
        assert a.compare_checksum(3, "one") is None
        assert b.compare_checksum(3, "other") == [a.peer_id]


def test_checksums_that_all_differ_are_a_warning(dhts, caplog):
    with group(dhts, n=3) as (a, b, c):
        for peer, value in ((a, "one"), (b, "other"), (c, "third")):
            peer.publish_checksum(3, value)
        with caplog.at_level(logging.WARNING, logger="distro_opt.comm.hivemind_membership"):
            assert a.compare_checksum(3, "one") is None  # a three-way split: nobody to reload from
        assert "no peer reloads state" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="distro_opt.comm.hivemind_membership"):
            assert a.compare_checksum(4, "one") is None  # no reports but ours: nothing to say
        assert "reloads" not in caplog.text


def test_clean_leave_is_seen_by_the_others_at_once(dhts):
    with group(dhts, n=2) as (a, b):
        b.membership.leave()
        a.membership.refresh()
        assert b.peer_id not in a.membership.view()


def test_a_peer_that_drops_out_of_the_view_for_a_round_is_still_waited_for(dhts):
    # a's view loses b for one round (b's heartbeat missed its TTL on a loaded machine): a round that
    # did not wait for b would apply a's payload alone while b applies both, and with two peers no
    # checksum majority would ever bring them back together; b starts its round later than a, so a
    # round that waits only for its view is over before b's payload comes
    with group(dhts, n=2, step_timeout_s=local.ROOMY_STEP_TIMEOUT_S) as (a, b):
        gather([(a, filled(1)), (b, filled(2))])
        a.membership.view = lambda: {}
        results, _ = local.gather_at([(a, filled(1), 0.0), (b, filled(2), 0.5)])
        assert [sorted(firsts(r)) for r in results] == [[1, 2], [1, 2]]
        assert a.step == b.step == 2


def test_a_peer_that_left_cleanly_is_not_waited_for(dhts):
    # b contributed to step 0, then announced a clean leave: a's next round must not wait for b until
    # its gather deadline (10 s here, against milliseconds for a round alone)
    step_timeout_s = 20.0
    with group(dhts, n=2, step_timeout_s=step_timeout_s) as (a, b):
        gather([(a, filled(1)), (b, filled(2))])
        b.membership.leave()
        a.membership.refresh()
        assert a.membership.has_left(b.peer_id)
        (result,), (duration,) = gather([(a, filled(1))], timeout_s=step_timeout_s + 5)
        assert firsts(result) == [1]
        assert duration < 0.25 * step_timeout_s


def test_a_peer_of_the_last_round_is_waited_for_though_the_view_never_showed_it(dhts):
    # b trains with a before a's view ever shows b: a joiner whose first heartbeats have not reached
    # a, or a peer whose records were on a DHT node that left. Its first round, started before a's,
    # counts through its push; the next one, started after a's, must be waited for as well, or a
    # applies its payload alone and b finds the step finished without it (out of sync)
    with group(dhts, n=2, step_timeout_s=local.ROOMY_STEP_TIMEOUT_S) as (a, b):
        a.membership.view = lambda: {}
        for offsets in ((0.5, 0.0), (0.0, 0.5)):  # (a, b): b starts first, then a does
            results, _ = local.gather_at([(a, filled(1), offsets[0]), (b, filled(2), offsets[1])])
            assert [sorted(firsts(r)) for r in results] == [[1, 2], [1, 2]], offsets
        assert not b.out_of_sync and a.step == b.step == 2


def test_a_round_started_before_a_leave_was_seen_does_not_wait_for_the_peer_that_left(dhts):
    # b took part in step 0 and leaves; a has not looked at the DHT since, so its next round still
    # expects b: b answers that round's stream at once instead of letting a wait out its deadline
    step_timeout_s = 20.0
    with group(dhts, n=2, step_timeout_s=step_timeout_s) as (a, b):
        gather([(a, filled(1)), (b, filled(2))])
        a.membership.refresh = lambda: None
        b.leave()
        assert not a.membership.has_left(b.peer_id) and b.peer_id in a.membership.view()
        (result,), (duration,) = gather([(a, filled(1))], timeout_s=step_timeout_s + 5)
        assert firsts(result) == [1]
        assert duration < 0.25 * step_timeout_s
        with pytest.raises(HivemindBackendError, match="this peer left the run"):
            b.all_gather(filled(2))


def test_overlapped_gathers_finish_as_separate_steps(dhts):
    roomy = local.ROOMY_STEP_TIMEOUT_S  # four streams open at once per peer: no deadline is under test
    with group(dhts, n=2, step_timeout_s=roomy) as (a, b):

        def two_in_flight(backend, first, second):
            pending = [backend.start_all_gather(filled(first)), backend.start_all_gather(filled(second))]
            return [sorted(firsts(p.wait())) for p in pending]

        results = [None, None]
        threads = [
            threading.Thread(target=lambda i=i, x=x: results.__setitem__(i, two_in_flight(x, 10 + i, 20 + i)))
            for i, x in enumerate((a, b))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3 * roomy + 5)
        assert results == [[[10, 11], [20, 21]]] * 2
        assert a.step == b.step == 2


def test_all_reduce_mean_of_an_integer_tensor_is_refused_before_anything_is_sent(dhts):
    with group(dhts, n=1) as (a,):
        t = torch.tensor([3, 10])
        with pytest.raises(ValueError, match="op='mean' of a torch.int64 tensor"):
            a.all_reduce(t, op="mean")
        assert t.tolist() == [3, 10] and a.step == 0


def test_a_rejected_stream_counts_its_hello_and_status_on_the_receiving_side(dhts):
    with group(dhts, n=2) as (a, b):

        async def hello_far_ahead():
            _, reader, writer = await raw_gather_stream(b, a)
            writer.write(wire.HELLO.pack(wire.GATHER_MAGIC, wire.VERSION, 0, 100, 1000))
            status = (await asyncio.wait_for(reader.readexactly(1), 5))[0]
            writer.close()
            return status

        sent, received = a.stats.bytes_sent, a.stats.bytes_received
        assert b._link.call(hello_far_ahead(), 10) == wire.REJECTED
        assert a.stats.bytes_received - received == wire.HELLO.size
        assert a.stats.bytes_sent - sent == 1


def test_exclusions_from_the_training_thread_and_the_event_loop_do_not_race(dhts, caplog):
    caplog.set_level(logging.ERROR)  # one warning per exclusion: thousands here
    with group(dhts, n=1) as (a,):
        stop = time.monotonic() + 1.0
        errors = []

        async def exclude_on_the_loop():  # what a bad payload does, on the backend's event loop
            i = 0
            while time.monotonic() < stop:
                a._admission.exclude(f"loop{i}", "bad size")
                i += 1
                if i % 100 == 0:
                    await asyncio.sleep(0)

        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads often: make the race show within a second
        try:
            future = asyncio.run_coroutine_threadsafe(exclude_on_the_loop(), a._link.loop)
            i = 0
            while time.monotonic() < stop:
                try:
                    a.report_invalid(f"train{i}")  # what the optimizer does on the training thread
                except RuntimeError as exc:
                    errors.append(exc)
                    break
                i += 1
            future.result(timeout=10)
        finally:
            sys.setswitchinterval(switch)
        assert errors == []


def new_threads_and_processes(before):
    threads, children = before
    return (
        [t.name for t in threading.enumerate() if t not in threads and t.is_alive()],
        [c.name for c in multiprocessing.active_children() if c not in children],
    )


def snapshot():
    return set(threading.enumerate()), set(multiprocessing.active_children())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(heartbeat_s=5.0, ttl_s=4.0), "heartbeat_s=5.0 must be > 0 and < ttl_s=4.0"),
        (dict(exclude_s=-1.0), "Invalid exclude_s: -1.0"),
        (dict(max_peers=0), "Invalid max_peers: 0"),
        (dict(max_state_nbytes=-1), "Invalid max_state_nbytes: -1"),
        (dict(state_timeout_s=0.0), "Invalid state_timeout_s: 0.0"),
        (dict(startup_timeout_s=0.0), "Invalid startup_timeout_s: 0.0"),
        (dict(untrusted_fraction=0.5), r"Invalid untrusted_fraction: 0.5 \(expected in \[0, 0.5\)\)"),
        (dict(untrusted_fraction=True), "Invalid untrusted_fraction: True"),
    ],
)
def test_invalid_settings_are_refused_before_anything_starts(kwargs, message):
    before = snapshot()
    with pytest.raises(ValueError, match=message):
        HivemindBackend(f"t{uuid.uuid4().hex[:10]}", **kwargs)
    assert new_threads_and_processes(before) == ([], [])


def fail_after_the_handlers_are_added(monkeypatch):
    def refuse(self):
        raise RuntimeError("membership could not start")

    monkeypatch.setattr(hivemind_backend.Membership, "start", refuse)


def test_a_failed_start_on_a_shared_dht_leaves_the_run_free_for_a_retry(dhts, monkeypatch):
    run_id = f"t{uuid.uuid4().hex[:10]}"
    fail_after_the_handlers_are_added(monkeypatch)
    before = snapshot()
    with pytest.raises(RuntimeError, match="membership could not start"):
        HivemindBackend(run_id, dht=dhts[0], heartbeat_s=0.3, ttl_s=1.5)
    assert new_threads_and_processes(before) == ([], [])
    monkeypatch.undo()
    HivemindBackend(run_id, dht=dhts[0], heartbeat_s=0.3, ttl_s=1.5).close()  # its stream handlers are free


def test_a_failed_start_shuts_down_the_dht_it_started(monkeypatch):
    fail_after_the_handlers_are_added(monkeypatch)
    before = snapshot()
    with pytest.raises(RuntimeError, match="membership could not start"):
        HivemindBackend(f"t{uuid.uuid4().hex[:10]}", heartbeat_s=0.3, ttl_s=1.5)
    assert new_threads_and_processes(before) == ([], [])


def test_start_gives_up_after_startup_timeout_s_when_the_dht_does_not_answer():
    dht = hivemind.DHT(start=True, host_maddrs=[LOOPBACK], **dht_options([LOOPBACK], None))
    os.kill(dht.pid, signal.SIGSTOP)  # alive but unresponsive, like a hung DHT process
    try:
        start = time.monotonic()
        with pytest.raises(HivemindBackendError, match="startup_timeout_s=1"):
            HivemindBackend(f"t{uuid.uuid4().hex[:10]}", dht=dht, startup_timeout_s=1.0)
        assert time.monotonic() - start < 5
    finally:
        os.kill(dht.pid, signal.SIGCONT)
        dht.shutdown()
