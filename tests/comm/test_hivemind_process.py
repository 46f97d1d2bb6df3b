"""The DHT process a HivemindBackend starts (``comm/hivemind_process.py``), tried on a real one in a
separate process: a Ctrl-C reaches the program only, and the DHT process ends with its owner."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("hivemind")

import _hm_local as local  # noqa: E402
from _procs import default_sigint  # noqa: E402

OWNER = str(Path(__file__).resolve().parents[1] / "_hm_owner.py")
pytestmark = pytest.mark.timeout(120)
dhts = local.dhts_fixture(1)


def start_owner(run_id: str, dht) -> tuple[subprocess.Popen, str, int]:
    """The owner program in a process group of its own, as a terminal starts a command; returns it,
    its peer id and its DHT process id, once it is ready."""
    maddr = str(dht.get_visible_maddrs()[0])
    proc = subprocess.Popen(
        [sys.executable, OWNER, run_id, maddr], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=default_sigint, env=dict(os.environ, HIVEMIND_LOGLEVEL="ERROR"),
    )
    line = proc.stdout.readline()  # bounded by the module timeout: the owner prints it or exits
    if not line.startswith("ready "):
        proc.kill()
        raise AssertionError(f"the owner did not start: {line}{proc.communicate(timeout=10)[0]}")
    _, peer_id, dht_pid = line.split()
    return proc, peer_id, int(dht_pid)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state, parent, ...), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children_of(pid: int) -> list[int]:
    parents = {int(e): stat_fields(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    return [p for p, fields in parents.items() if fields is not None and fields[1] == str(pid)]


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie waiting to be reaped has ended)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_ctrl_c_reaches_the_program_only_so_its_leave_is_announced(dhts):
    run_id = f"t{uuid.uuid4().hex[:10]}"
    a = local.HivemindBackend(run_id, dht=dhts[0], heartbeat_s=0.3, ttl_s=1.5)  # reads the owner's records
    try:
        proc, peer_id, dht_pid = start_owner(run_id, dhts[0])
        try:
            daemons = children_of(dht_pid)
            assert len(daemons) == 1, daemons  # the p2p daemon
            wait_until(lambda: peer_id in a.membership.view(), 20, "the owner never appeared in the view")
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends

            def left():
                a.membership.refresh()
                return a.membership.has_left(peer_id)

            wait_until(left, 20, "the owner's leave never reached the run")
            assert running(dht_pid) and running(daemons[0]), "the Ctrl-C stopped the DHT process or daemon"
            output = proc.communicate("\n", timeout=60)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0 and output.splitlines() == ["left"], output
    finally:
        a.close()


def test_the_dht_process_and_its_daemon_end_when_their_owner_is_killed(dhts):
    proc, _, dht_pid = start_owner(f"t{uuid.uuid4().hex[:10]}", dhts[0])
    try:
        daemons = children_of(dht_pid)
        assert len(daemons) == 1, daemons
        os.kill(proc.pid, signal.SIGKILL)  # the owner alone: its DHT process runs in another session
        proc.wait(timeout=10)
        wait_until(lambda: not any(running(p) for p in [dht_pid, *daemons]), 20,
                   "the DHT process or its p2p daemon outlived their owner")
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in [dht_pid, *children_of(dht_pid)]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
