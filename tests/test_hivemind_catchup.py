"""Serving and downloading state (hivemind_catchup), and who may ask: peers in one process, on 127.0.0.1."""

import asyncio
import threading
import time

import pytest
import torch

pytest.importorskip("hivemind")

from hivemind.p2p import PeerID  # noqa: E402

from distro_opt.comm import hivemind_wire as wire  # noqa: E402
from distro_opt.comm.hivemind_backend import HivemindBackend, HivemindBackendError  # noqa: E402
from distro_opt.comm.hivemind_state import dump_state  # noqa: E402


import _hm_local as local  # noqa: E402
group, wait_all, gather = local.group, local.wait_all, local.gather
filled, firsts = local.filled, local.firsts
pytestmark = pytest.mark.timeout(60)


dhts = local.dhts_fixture(3)


class StatelessPeer(HivemindBackend):
    """Serves a blob that parses and has a step, but no ``"state"`` entry."""

    def _snapshot(self):
        return dump_state({"step": 12345})


def announce_step(peer, step):
    """Make ``peer``'s heartbeat report ``step``, so that joiners try it first."""
    peer.membership.step = step
    peer.membership.beat()


def test_a_state_without_a_state_entry_is_skipped_for_the_next_peer(dhts):
    with group(dhts, classes={1: StatelessPeer}) as (a, bad, joiner):
        a.state_provider = lambda: {"w": torch.arange(3.0)}
        bad.state_provider = lambda: {}
        announce_step(bad, 9)
        state = joiner.load_state_from_peers(prefer=[bad.peer_id, a.peer_id])
        assert state["w"].tolist() == [0.0, 1.0, 2.0]
        assert joiner.step == a.step == 0


def test_a_state_without_a_state_entry_raises_a_backend_error_and_keeps_the_step(dhts):
    with group(dhts, n=2, classes={1: StatelessPeer}) as (joiner, bad):
        bad.state_provider = lambda: {}
        with pytest.raises(HivemindBackendError, match="no 'state' entry"):
            joiner.load_state_from_peers()
        assert joiner.step == 0


def test_a_snapshot_is_labelled_with_the_step_its_provider_flushed_to(dhts):
    with group(dhts) as (a, b, joiner):
        applied, pending = [], {}

        def provider():  # like DisTrOAdamW(overlap=True).state_dict(): apply the pending round first
            if "round" in pending:
                pending.pop("round").wait()
                applied.append(1)
            return {"rounds_applied": len(applied)}

        a.state_provider = provider
        pending["round"] = a.start_all_gather(filled(1))  # round 0 in flight between two steps
        slow_b = threading.Thread(target=lambda: (time.sleep(0.5), b.all_gather(filled(2))), daemon=True)
        slow_b.start()
        state = joiner.load_state_from_peers(prefer=[a.peer_id])
        slow_b.join(10)
        assert state == {"rounds_applied": 1}
        assert joiner.step == 1  # the state is after round 0: the joiner's next round is 1


def test_a_private_run_serves_no_state_or_log_to_a_peer_not_on_its_allow_list(dhts):
    with group(dhts, wait=False) as (a, b, stranger):
        for x in (a, b):
            x.allow_peers = {a.peer_id, b.peer_id}
        a.state_provider = lambda: {"secret": torch.ones(2)}
        local.wait_all_visible([a, b, stranger])
        gather([(a, filled(1)), (b, filled(2))])
        with pytest.raises(HivemindBackendError, match="served its state"):
            stranger.load_state_from_peers(prefer=[a.peer_id])
        with pytest.raises(Exception, match="no log of step 0"):
            stranger._call(stranger._fetch_log(a.peer_id, 0, 1000), 10)


def test_wait_for_peers_counts_only_peers_on_the_allow_list(dhts):
    with group(dhts, wait=False) as (a, b, stranger):
        local.wait_all_visible([a, b, stranger])
        a.allow_peers = {a.peer_id, b.peer_id}
        assert a.wait_for_peers(2, 0.5) == 1


def test_concurrent_state_requests_share_one_snapshot_and_never_delay_payload_validation(dhts):
    with group(dhts, wait=False) as (a, b, stranger):  # the stranger never announces itself
        wait_all([a, b], 1)
        for x in (a, b):
            x.payload_validator = lambda buf: True
        made = []
        a.state_provider = lambda: made.append(1) or {"w": torch.zeros(4)}
        ready, go, out = threading.Event(), threading.Event(), {}

        def train_a():  # what experiments/peer.py does: the step, gather included, under state_lock
            with a.state_lock:
                ready.set()
                go.wait(10)
                out["a"] = a.all_gather(filled(1))

        trainer = threading.Thread(target=train_a, daemon=True)
        trainer.start()
        ready.wait(10)
        requests = [  # eight joiners at once, while a snapshot waits for the training step
            asyncio.run_coroutine_threadsafe(stranger._fetch_state(a.peer_id), stranger._loop)
            for _ in range(8)
        ]
        time.sleep(0.5)
        go.set()
        (at_b,), _ = gather([(b, filled(2))])
        trainer.join(10)
        assert sorted(firsts(out["a"])) == sorted(firsts(at_b)) == [1, 2]
        blobs = [f.result(timeout=10) for f in requests]  # none refused
        assert len(set(blobs)) == 1 and len(made) == 1  # one snapshot, one copy, served to all


def test_a_joiner_waits_for_a_training_step_longer_than_two_rounds(dhts):
    with group(dhts, n=2, options={0: {"step_timeout_s": 0.5}}) as (a, joiner):
        a.state_provider = lambda: {"w": torch.arange(3.0)}
        out = []
        join = threading.Thread(target=lambda: out.append(joiner.load_state_from_peers()), daemon=True)
        with a.state_lock:  # a step computing for 1.5 s = 3 * step_timeout_s
            join.start()
            time.sleep(1.5)
        join.join(10)
        assert out and out[0]["w"].tolist() == [0.0, 1.0, 2.0]


async def ask_and_never_read(requester, server, hold_s):
    _, _, writer = await requester._p2p.call_binary_stream_handler(
        PeerID.from_base58(server.peer_id), f"distro/{server.run_id}/state"
    )
    writer.write(wire.STATE_MAGIC)
    await asyncio.sleep(hold_s)
    writer.close()


def test_requesters_that_never_read_share_one_copy_of_the_state(dhts):
    with group(dhts, n=2) as (a, stranger):
        made = []
        a.state_provider = lambda: made.append(1) or {"w": torch.zeros(8 << 20)}  # 32 MiB
        futures = []
        for _ in range(4):  # one after another, each while the earlier ones are still being sent
            ask = ask_and_never_read(stranger, a, 1.2)
            futures.append(asyncio.run_coroutine_threadsafe(ask, stranger._loop))
            time.sleep(0.25)
        assert len(made) == 1  # one blob for all four, not one copy of the state per request
        for f in futures:
            f.result(timeout=10)
