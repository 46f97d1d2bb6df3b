"""The network lab: a capped link is felt by a real TCP transfer, the kernel's counters see the
bytes sent, and nothing the lab made outlives it. Needs root, ``ip netns`` and ``tbf`` (the lab
itself says which is missing); the refusal tests run anywhere."""
import json
import os
import select
import shutil
import signal
import subprocess
import sys

import pytest

from _procs import default_sigint
from distro_opt.experiments.netlab import Lab, LabUnavailable, check_can_run, lab_namespaces, transfer

MB = 1_000_000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cannot_run() -> str | None:
    try:
        check_can_run()
    except LabUnavailable as exc:
        return str(exc)
    return None


needs_lab = pytest.mark.skipif(_cannot_run() is not None, reason=f"{_cannot_run()}")


def _line(proc, timeout_s: float = 60) -> str:
    """The next line of ``proc`` (started with ``stdout=PIPE, bufsize=0``: no buffer for select to miss)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no line from the process within {timeout_s} s"
    return proc.stdout.readline().decode()


def _seconds_at(rate_mbit: float, nbytes: int) -> float:
    return nbytes * 8 / (rate_mbit * 1e6)


@needs_lab
def test_a_10_mbit_link_caps_a_tcp_transfer_and_the_kernel_counts_its_bytes():
    nbytes = 4 * MB  # 3.2 s at 10 Mbit/s: tbf's burst (16 KiB) is 0.4% of it
    with Lab(n=2, rate_mbit=10) as lab:
        prefix = lab.prefix
        assert len(lab_namespaces(prefix)) == 3  # two peers and the router
        capped = transfer(lab, 0, 1, nbytes)
        for p in (0, 1):  # the rate changes mid-run: both ends of the path
            lab.set_rate(p, 100)
        faster = transfer(lab, 0, 1, nbytes)
    assert capped["bytes"] == faster["bytes"] == nbytes
    assert 0.8 * _seconds_at(10, nbytes) <= capped["seconds"] <= 1.2 * _seconds_at(10, nbytes), capped
    # the kernel counts TCP/IP framing and retransmits too: a few percent over the payload
    for side in ("src_tx_bytes", "dst_rx_bytes"):
        assert abs(capped[side] - nbytes) <= 0.05 * nbytes, capped
        assert abs(faster[side] - nbytes) <= 0.05 * nbytes, faster
    # less one header per packet, the sender's counters give the payload (to a SYN's options and
    # retransmits, which count again)
    for probe in (capped, faster):
        assert abs(probe["src_tx_payload"] - nbytes) <= 0.005 * nbytes, probe
    assert faster["seconds"] < 0.5 * capped["seconds"], (capped, faster)
    assert lab_namespaces(prefix) == []


@needs_lab
def test_a_failure_inside_the_lab_removes_its_namespaces_and_processes():
    with pytest.raises(RuntimeError, match="boom"):
        with Lab(n=2, rate_mbit=100) as lab:
            prefix = lab.prefix
            sleeper = lab.popen(1, ["sleep", "120"])
            assert lab.run(0, ["ip", "-br", "addr", "show", "dev", "eth0"]).stdout.split()[2] == "10.213.0.10/24"
            raise RuntimeError("boom")
    assert lab_namespaces(prefix) == []
    assert sleeper.poll() is not None


@needs_lab
@pytest.mark.skipif(shutil.which("iptables") is None, reason="NAT needs iptables (Debian package iptables)")
def test_a_peer_behind_nat_reaches_a_public_peer_but_not_the_other_way():
    server = ("import socket; s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(1); print('up', flush=True);"
              " c, a = s.accept(); print(a[0], flush=True)")
    with Lab(n=2, nat=1) as lab:
        nat_peer = lab.peers[1]
        assert nat_peer.behind_nat and nat_peer.address.startswith("10.213.1.")
        srv = lab.popen(0, [sys.executable, "-c", server], stdout=subprocess.PIPE, bufsize=0)
        assert _line(srv).strip() == "up"
        joined = lab.run(1, [sys.executable, "-c", "import socket; socket.create_connection(('10.213.0.10', 7000), timeout=10)"])
        assert joined.returncode == 0, joined.stderr
        assert srv.communicate(timeout=30)[0].decode().strip() == "10.213.0.2"  # masqueraded as the NAT's address
        inward = lab.run(0, [sys.executable, "-c", f"import socket; socket.create_connection(('{nat_peer.address}', 7000), timeout=3)"])
        assert inward.returncode != 0 and "unreachable" in inward.stderr


def test_a_non_root_user_is_refused_in_one_line_and_nothing_is_made():
    before = lab_namespaces() if shutil.which("ip") else []
    with pytest.raises(LabUnavailable, match=r"^netlab needs root .*uid 1000\)$"):
        with Lab(n=2, rate_mbit=10, euid=1000):
            pass
    assert (lab_namespaces() if shutil.which("ip") else []) == before


def test_the_cli_refuses_with_exit_code_2_where_the_lab_cannot_run():
    # no `ip` nor `tc` on this PATH (as root), or not root: either way a one-line refusal
    env = {**os.environ, "PATH": "/nonexistent"}
    done = subprocess.run([sys.executable, "-m", "experiments.netlab", "--peers", "2", "--rate", "10mbit"],
                          capture_output=True, text=True, timeout=60, env=env,
                          cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: netlab needs "), done.stderr


def test_the_cli_rejects_an_unknown_rate_with_exit_code_2():
    done = subprocess.run([sys.executable, "-m", "experiments.netlab", "--rate", "fast"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "invalid rate: 'fast'" in done.stderr


@needs_lab
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_the_cli_interrupted_mid_run_removes_its_namespaces_and_commands(sig, code):
    cli = subprocess.Popen([sys.executable, "-m", "experiments.netlab", "--peers", "2", "--rate", "10mbit",
                            "--", "sleep", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                           cwd=ROOT, preexec_fn=default_sigint)
    try:
        namespace = json.loads(_line(cli))["namespace"]  # printed once the lab is built
        prefix = namespace.rsplit("-", 1)[0] + "-"
        assert namespace in lab_namespaces(prefix)
        json.loads(_line(cli))
        cli.send_signal(sig)
        assert cli.wait(timeout=60) == code, cli.stderr.read()
    finally:
        if cli.poll() is None:
            cli.kill()  # SIGKILL: nothing cleans up then but --remove-stale
            cli.wait(timeout=10)
            subprocess.run([sys.executable, "-m", "experiments.netlab", "--remove-stale"], timeout=60, cwd=ROOT)
    assert lab_namespaces(prefix) == []


@needs_lab
def test_remove_stale_deletes_only_the_labs_whose_process_has_ended():
    killed = subprocess.Popen([sys.executable, "-m", "experiments.netlab", "--peers", "1", "--", "sleep", "120"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, cwd=ROOT)
    try:
        stale = json.loads(_line(killed))["namespace"].rsplit("-", 1)[0] + "-"
    finally:
        killed.kill()
        killed.wait(timeout=10)
    with Lab(n=1) as live:
        assert lab_namespaces(stale) and lab_namespaces(live.prefix)
        done = subprocess.run([sys.executable, "-m", "experiments.netlab", "--remove-stale"],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        assert lab_namespaces(stale) == [] and len(lab_namespaces(live.prefix)) == 2
