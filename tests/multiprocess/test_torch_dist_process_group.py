"""experiments.process_group: a rendezvous file left by an earlier job is refused, not hung on; the
mains delete theirs on every way out; a world of one keeps its socket on 127.0.0.1.

Multi-process tests launch real ranks (Gloo on 127.0.0.1, the rendezvous in a file), each bounded
by a wall-clock timeout; whatever is left is killed on the way out.
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from distro_opt.experiments.process_group import one_machine_env, single_process_group

from _ranks import launch, read_logs


def test_rendezvous_file_of_a_killed_job_is_refused_on_every_rank_instead_of_hanging(tmp_path):
    results, codes = launch([["killed", "killed", []]], 2, tmp_path, timeout_s=40)
    assert codes == [-signal.SIGKILL] * 2, read_logs(tmp_path, 2)
    stale = tmp_path / "rendezvous"
    assert stale.exists()  # a killed rank cannot delete it
    # the same file. Refused by its records, at once: a rank that waited instead would reach the
    # launch's bound and be killed, or time out with another error, not this one
    results, codes = launch([["raw", "raw", []]], 2, tmp_path, timeout_s=60)
    assert codes == [3, 3], read_logs(tmp_path, 2)
    for res in results:
        assert res["start"]["error_type"] == "RendezvousError"
        error = res["start"]["error"]
        assert error.startswith(f"rendezvous file {stale} is left over from an earlier job (its rank ")
        assert error.endswith("which has ended); delete it or choose a fresh path for "
                              "DISTRO_OPT_RENDEZVOUS_FILE")
    assert stale.exists()  # refused, not deleted: the message says what to do


def test_rendezvous_file_nobody_wrote_to_for_longer_than_the_timeout_is_refused(monkeypatch, tmp_path):
    from distro_opt.experiments.process_group import start_process_group

    stale = tmp_path / "rendezvous"
    stale.write_bytes(b"\x00" * 16)  # no process records (as left by a version before them)
    os.utime(stale, (time.time() - 100, time.time() - 100))
    monkeypatch.setenv("DISTRO_OPT_RENDEZVOUS_FILE", str(stale))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"left over from an earlier job \(last written 100 s ago, longer "
                                           r"than the 5 s timeout\); delete it or choose a fresh path"):
        start_process_group("gloo", datetime.timedelta(seconds=5))


MEET = textwrap.dedent("""
    import datetime, sys
    import torch.distributed as dist
    from distro_opt.experiments.process_group import (
        RendezvousError, remove_rendezvous_file, start_process_group)

    try:
        joined = start_process_group("gloo", datetime.timedelta(seconds=15))
    except RendezvousError as exc:
        sys.exit(f"error: {exc}")
    dist.barrier()
    dist.destroy_process_group()
    remove_rendezvous_file(joined)
    print("met")
""")


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare --pid` (root or user namespaces)")
def test_ranks_in_different_pid_namespaces_of_one_host_meet(tmp_path):
    # Two containers with the host's network and a shared volume: one hostname, separate pids. Rank
    # 0's record names a pid of its own namespace, which means nothing (or another process) in rank 1's.
    from _procs import wait_all

    rendezvous = tmp_path / "rendezvous"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", MEET]
    procs = [subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *cmd],
                              env={**env, **one_machine_env(0, 2, rendezvous)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    deadline = time.monotonic() + 20
    while not (rendezvous.exists() and b"distro_opt/process/0" in rendezvous.read_bytes()):
        assert time.monotonic() < deadline and procs[0].poll() is None, "rank 0 never wrote its record"
        time.sleep(0.05)
    procs.append(subprocess.Popen(cmd, env={**env, **one_machine_env(1, 2, rendezvous)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    # a bound for a hang only: the ranks' own rendezvous timeout (15 s) ends a failed meeting, and
    # two torch imports and a Gloo group took over 30 s on a loaded 2-core machine
    assert wait_all(procs, 90) == [(0, "")] * 2
    assert not rendezvous.exists()


def test_a_record_is_checked_only_in_its_own_pid_namespace_and_boot(monkeypatch):
    from distro_opt.experiments import process_group as pg

    ended = subprocess.Popen(["true"])
    ended.wait(timeout=10)
    host, me = socket.gethostname(), os.getpid()
    namespace, boot = pg._pid_space()
    mine = pg._start_time(me)
    assert pg._this_process() == f"{host} {me} {mine} {namespace} {boot}"
    assert not pg._has_ended(pg._this_process())
    assert pg._has_ended(f"{host} {ended.pid} 12345 {namespace} {boot}")
    assert pg._has_ended(f"{host} {me} {int(mine) + 1} {namespace} {boot}")  # a reused pid
    assert pg._has_ended(f"{host} {ended.pid} 12345")  # a record of an earlier version
    # Cannot be checked from here, so running: another namespace (a container sharing the host name),
    # another boot (another machine, any name), or a start time this user cannot read (hidepid).
    assert not pg._has_ended(f"{host} {ended.pid} 12345 pid:[1] {boot}")
    assert not pg._has_ended(f"{host} {ended.pid} 12345 {namespace} another-boot")
    assert not pg._has_ended(f"other {me} {int(mine) + 1} pid:[1] another-boot")
    assert not pg._has_ended(f"other-name {me} {mine} {namespace} {boot}")  # same kernel and pids
    monkeypatch.setattr(pg, "_start_time", lambda pid: "-")
    assert not pg._has_ended(f"{host} {me} {int(mine) + 1} {namespace} {boot}")
    monkeypatch.setattr(pg, "_pid_space", lambda: ("-", boot))  # /proc of another namespace: no check
    assert not pg._has_ended(f"{host} {ended.pid} 12345 - {boot}")


def test_a_rank_leaving_deletes_only_the_file_it_joined_not_a_newer_jobs(monkeypatch, tmp_path):
    # A job restarted while a slow rank of the old one is still ending: that rank must not delete
    # the new job's file (its ranks would then meet in two different files and time out).
    import torch.distributed as dist

    from distro_opt.experiments.process_group import remove_rendezvous_file, start_process_group

    rendezvous = tmp_path / "rendezvous"
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)  # the file part only
    for name, value in one_machine_env(0, 2, rendezvous).items():
        monkeypatch.setenv(name, value)
    old = start_process_group("gloo", datetime.timedelta(seconds=5))
    assert rendezvous.exists()
    rendezvous.unlink()  # the old job's other rank, gone
    rendezvous.write_bytes(b"the new job's file")
    remove_rendezvous_file(old)
    assert rendezvous.read_bytes() == b"the new job's file"
    rendezvous.unlink()
    joined = start_process_group("gloo", datetime.timedelta(seconds=5))
    remove_rendezvous_file(joined)
    assert not rendezvous.exists()  # its own file: deleted
    remove_rendezvous_file(joined)  # already gone: nothing to do


def _train_ddp(rank, rendezvous, log, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **one_machine_env(rank, 2, rendezvous)}
    return subprocess.Popen([sys.executable, "-m", "distro_opt.experiments.train_ddp", "--timeout-s", "20",
                             *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_all(procs, timeout_s):
    deadline = time.monotonic() + timeout_s
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_a_failed_hand_launched_train_ddp_job_deletes_its_file_and_the_same_command_runs_again(tmp_path):
    rendezvous, logs = tmp_path / "rendezvous", [tmp_path / "log0.txt", tmp_path / "log1.txt"]
    with open(logs[0], "w") as log0, open(logs[1], "w") as log1:
        procs = [_train_ddp(0, rendezvous, log0, "--steps", "100000"),
                 _train_ddp(1, rendezvous, log1, "--steps", "100000", "--no-log")]
        deadline = time.monotonic() + 30
        while "step    2 |" not in logs[0].read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        procs[1].kill()  # a rank dies mid-run: rank 0 leaves through CollectiveError -> os._exit(1)
        assert _wait_all(procs, 20) == [1, -signal.SIGKILL], logs[0].read_text()[-2000:]
    assert "rank 0 of 2: all_gather did not complete" in logs[0].read_text()
    assert not rendezvous.exists()
    with open(logs[0], "w") as log0, open(logs[1], "w") as log1:  # the same command, after the failure
        codes = _wait_all([_train_ddp(r, rendezvous, log, "--steps", "2", "--no-log")
                           for r, log in ((0, log0), (1, log1))], 30)
    assert codes == [0, 0], logs[0].read_text()[-2000:] + logs[1].read_text()[-2000:]
    assert not rendezvous.exists()


END = textwrap.dedent("""
    import atexit, datetime, sys
    from pathlib import Path
    import torch.distributed as dist
    from distro_opt.experiments.process_group import RendezvousFile, end_process, single_process_group

    single_process_group("gloo", datetime.timedelta(seconds=10))
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda: (print("destroyed", file=sys.stderr), destroy())
    atexit.register(lambda: print("finalized", file=sys.stderr))  # only in the interpreter's finalization
    print("the last line")  # to a pipe: still in the buffer
    code, how, rendezvous = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    end_process(code, RendezvousFile(Path(rendezvous), "this job"), destroy_group=how == "destroy")
""")


@pytest.mark.parametrize("how", ["destroy", "abandon"])
def test_end_process_flushes_deletes_the_file_and_exits_without_finalization(tmp_path, how):
    rendezvous = tmp_path / "rendezvous"
    rendezvous.write_text("this job")
    out = subprocess.run([sys.executable, "-c", END, "7", how, str(rendezvous)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 7, out.stderr
    assert out.stdout == "the last line\n"
    assert out.stderr == ("destroyed\n" if how == "destroy" else ""), out.stderr  # and not "finalized"
    assert not rendezvous.exists()


def test_world_of_one_creates_its_gloo_device_on_loopback(monkeypatch):
    import torch.distributed as dist

    seen = []
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # even where the environment names another one
    monkeypatch.setattr(dist, "init_process_group",
                        lambda *a, **k: seen.append(os.environ["GLOO_SOCKET_IFNAME"]))
    single_process_group("gloo", datetime.timedelta(seconds=5))
    assert seen == ["lo"]
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0"  # the caller's setting, back


LISTENING = textwrap.dedent("""
    import datetime, os
    import torch.distributed as dist
    from distro_opt.experiments.process_group import single_process_group

    single_process_group("gloo", datetime.timedelta(seconds=10))
    links = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
             if os.path.islink(f"/proc/self/fd/{fd}")]
    inodes = {link[8:-1] for link in links if link.startswith("socket:[")}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                print(table, fields[1])
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_world_of_one_listens_on_127_0_0_1_only():
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    out = subprocess.run([sys.executable, "-c", LISTENING], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    sockets = out.stdout.split("\n")[:-1]
    assert sockets  # Gloo's transport listens once
    assert all(s.startswith("/proc/net/tcp 0100007F:") for s in sockets), sockets  # 127.0.0.1, any port
