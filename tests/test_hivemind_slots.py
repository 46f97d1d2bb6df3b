"""Gather stream slots (hivemind_round): strangers that open streams and say nothing (127.0.0.1)."""

import asyncio

import pytest

pytest.importorskip("hivemind")

from hivemind.p2p import PeerID  # noqa: E402

from distro_opt.comm import hivemind_wire as wire  # noqa: E402


import _hm_local as local  # noqa: E402
group, wait_all, gather = local.group, local.wait_all, local.gather
filled, firsts = local.filled, local.firsts
pytestmark = pytest.mark.timeout(60)


dhts = local.dhts_fixture(4)


async def hold_a_slot(squatter, target, step: int, hold_s: float) -> None:
    """Open a gather stream to ``target`` for ``step``, say hello, then nothing."""
    _, _, writer = await squatter._p2p.call_binary_stream_handler(
        PeerID.from_base58(target.peer_id), f"distro/{target.run_id}/gather"
    )
    try:
        writer.write(wire.HELLO.pack(wire.GATHER_MAGIC, wire.VERSION, 0, step, 1000))
        await asyncio.sleep(hold_s)
    finally:
        writer.close()


def test_strangers_holding_streams_neither_lock_out_nor_delay_the_known_peers(dhts):
    # max_peers=2: two squatters would have taken every slot of a's round 0 before it started
    with group(dhts, n=4, options={0: {"max_peers": 2}}, wait=False) as (a, b, s1, s2):
        wait_all([a, b], 1)  # the squatters never announce themselves active
        squats = [
            asyncio.run_coroutine_threadsafe(hold_a_slot(s, a, 0, 3 * local.STEP_TIMEOUT_S), s._loop)
            for s in (s1, s2)
        ]
        try:
            (at_a, at_b), times = gather([(a, filled(1)), (b, filled(2))])
        finally:
            for f in squats:
                f.cancel()
        assert sorted(firsts(at_a)) == sorted(firsts(at_b)) == [1, 2]
        assert times[0] < 0.5  # a did not wait for the squatters until its gather deadline (1 s)
