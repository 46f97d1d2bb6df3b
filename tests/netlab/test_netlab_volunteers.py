"""Volunteer peers across the network lab's NAT: real peer programs, one per namespace.

Two public peers listen on their lab addresses; a third sits behind the lab's NAT namespace
(MASQUERADE), which nobody outside can reach (``test_netlab.py`` checks that), and joins through the
first peer's address. It must take part in every step (each peer sees 3 contributors) and end with
the same parameters as the others, with no replica reload: whether it runs in ``--client-mode`` or
announces its private address, which nobody can dial (libp2p then reuses the connections it opened).
"""
import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("hivemind")

from distro_opt.experiments.netlab import Lab, LabUnavailable, check_can_run  # noqa: E402


from _hm_cluster import Peer  # noqa: E402
PEER_PROGRAM = str(Path(__file__).resolve().parents[1].joinpath("_hm_peer.py"))
STEPS = 8


def _cannot_run() -> str | None:
    try:
        check_can_run(nat=True)
    except LabUnavailable as exc:
        return str(exc)
    return None


pytestmark = [
    pytest.mark.skipif(_cannot_run() is not None, reason=f"{_cannot_run()}"),
    pytest.mark.timeout(240),
]


def _wait_for_file(path: Path, peer, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline or peer.proc.poll() is not None:
            raise AssertionError(f"{path.name} not written:\n{peer.output()}")
        time.sleep(0.1)
    return path.read_text()


@pytest.mark.parametrize("nat_flags", [["--client-mode"], ["--host-maddrs", "{address}"]],
                         ids=["client-mode", "private-address"])
def test_a_peer_behind_nat_trains_every_step_in_lockstep_with_the_public_peers(tmp_path, nat_flags):
    common = ["--run-id", "natlab", "--steps", str(STEPS), "--min-peers", "3", "--wait-peers-s", "60",
              "--step-timeout-s", "4", "--heartbeat-s", "0.5", "--ttl-s", "2", "--checksum-every", "2",
              "--linger-s", "3"]
    peers = []
    with Lab(n=3, rate_mbit=100, nat=1) as lab:
        assert [p.behind_nat for p in lab.peers] == [False, False, True]

        def start(i, *flags):
            flags = [f.format(address=f"/ip4/{lab.peers[i].address}/tcp/0") for f in flags]
            argv = [sys.executable, PEER_PROGRAM, *common, "--shard", str(i), "--out", f"p{i}.json", *flags]
            peers.append(Peer(f"peer {i}", lab.argv(i, argv), tmp_path))
            return peers[-1]

        try:
            first = start(0, "--host-maddrs", "{address}", "--maddrs-file", "first.addr")
            maddrs = _wait_for_file(tmp_path / "first.addr", first, 90).split()
            assert maddrs and all(m.startswith(f"/ip4/{lab.peers[0].address}/") for m in maddrs), maddrs
            start(1, "--host-maddrs", "{address}", "--initial-peers", *maddrs)
            start(2, *nat_flags, "--initial-peers", *maddrs)
            codes = [peer.wait_exit(180) for peer in peers]
            assert codes == [0, 0, 0], "\n".join(p.output() for p in peers)
        finally:
            for peer in peers:
                peer.kill()
    summaries = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(3)]
    assert [s["final_step"] for s in summaries] == [STEPS] * 3
    assert [s["resyncs"] for s in summaries] == [0, 0, 0]  # nobody had to reload a diverged replica
    assert len({s["checksum"] for s in summaries}) == 1, [s["checksum"] for s in summaries]
    for peer in peers:  # every step had all three contributors, the one behind NAT included
        assert [step["peers"] for step in peer.steps()] == [3] * STEPS, peer.output()
