"""Start and end the torch.distributed process group of a job, from the launcher's environment.

By default this is torch's env:// start (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT), with its TCP rendezvous store. A one-machine job launched by hand can instead set
``DISTRO_OPT_RENDEZVOUS_FILE`` to a fresh path (plus RANK and WORLD_SIZE): the ranks then meet
through a ``torch.distributed.FileStore`` in that file, and nothing listens on a port for them.
The tests launch their ranks this way. A TCP store's clients also look up a name for the
store's address (torch does it for its log lines). Where /etc/hosts lacks an entry for the
IPv4-mapped address they connect through, that lookup is a DNS query off the machine, even for
127.0.0.1.

A FileStore deletes its file only when every rank ends cleanly. A file left by an earlier job
(a rank killed, or one that left through ``os._exit``) holds that job's addresses: ranks that
meet in it connect to dead ports and hang in ``init_process_group``. So each rank records its
process in the file, a rank refuses a file whose recorded processes have ended (or that nobody
wrote to for longer than the timeout), and the mains delete the file on every way out
(``remove_rendezvous_file``).
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

RENDEZVOUS_FILE = "DISTRO_OPT_RENDEZVOUS_FILE"
_PROCESS_KEY = "distro_opt/process/{rank}"  # "host pid start-time" of the rank that joined the file


class RendezvousError(RuntimeError):
    """The rendezvous file cannot be used (left over from an earlier job, or RANK/WORLD_SIZE missing)."""


def start_process_group(backend: str, timeout: datetime.timedelta) -> Path | None:
    """``dist.init_process_group(backend)`` from the environment; end it with destroy_process_group.
    Returns the rendezvous file the ranks met in (None: torch's TCP store): pass it to
    ``remove_rendezvous_file`` on every way out of the process, ``os._exit`` included."""
    path = os.environ.get(RENDEZVOUS_FILE)
    if path is None:
        dist.init_process_group(backend, timeout=timeout)
        return None
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise RendezvousError(
            f"{RENDEZVOUS_FILE} is set but {' and '.join(missing)} not: set RANK (0 .. WORLD_SIZE-1) "
            "and WORLD_SIZE in every process of the job"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _refuse_unused_file(path, timeout)
    store = dist.FileStore(path, world_size)
    store.set_timeout(timeout)
    _refuse_ended_job(store, path, world_size)
    store.set(_PROCESS_KEY.format(rank=rank), _this_process())
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:
        remove_rendezvous_file(path)  # this job's file, never to be met in again: do not leave it stale
        raise
    return Path(path)


def remove_rendezvous_file(path) -> None:
    """Delete the rendezvous file ``path`` returned by start_process_group (None: nothing to do). A
    peer still using the file is harmless: a FileStore that writes again recreates the file without
    process records, which the next job accepts."""
    if path is not None:
        Path(path).unlink(missing_ok=True)


def _stale(path: str, why: str) -> RendezvousError:
    return RendezvousError(
        f"rendezvous file {path} is left over from an earlier job ({why}); delete it or choose a "
        f"fresh path for {RENDEZVOUS_FILE}"
    )


def _refuse_unused_file(path: str, timeout: datetime.timedelta) -> None:
    """Ranks of one job all arrive within ``timeout`` of the first one's last write, or time out."""
    try:
        age_s = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return
    if age_s > timeout.total_seconds():
        raise _stale(path, f"last written {age_s:.0f} s ago, longer than the {timeout.total_seconds():g} s "
                           "timeout")


def _refuse_ended_job(store, path: str, world_size: int) -> None:
    """A rank whose process has ended cannot be a peer of this job: its records mean an old file."""
    for rank in range(world_size):
        key = _PROCESS_KEY.format(rank=rank)
        if not store.check([key]):
            continue
        record = store.get(key).decode("utf-8", "replace")
        if not _is_running(record):
            host, pid = (record.split() + ["?", "?"])[:2]
            raise _stale(path, f"its rank {rank} was process {pid} on {host}, which has ended")


def _this_process() -> str:
    return f"{socket.gethostname()} {os.getpid()} {_start_time(os.getpid())}"


def _start_time(pid: int) -> str:
    """When process ``pid`` started (Linux: clock ticks since boot), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "-"
    return stat[stat.rindex(")") + 2:].split()[19]  # field 22 of proc_pid_stat(5)


def _is_running(record: str) -> bool:
    parts = record.split()
    if len(parts) != 3 or not parts[1].isdigit():
        return False
    host, pid, started = parts[0], int(parts[1]), parts[2]
    if host != socket.gethostname():
        return True  # another machine's process (a shared filesystem): cannot be checked from here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    return started == "-" or _start_time(pid) == started


def one_machine_env(rank: int, world_size: int, rendezvous_file) -> dict[str, str]:
    """The variables of rank ``rank`` of a one-machine job launched by hand (add them to the rest of
    its environment): rank and world size, the rendezvous file, and Gloo's own sockets on loopback."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        RENDEZVOUS_FILE: str(rendezvous_file),
        "GLOO_SOCKET_IFNAME": "lo",
    }


def single_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """A group of this process alone, whose store lives in memory (no rendezvous port).

    Gloo still opens one listening socket for its transport, on the address the hostname resolves
    to unless GLOO_SOCKET_IFNAME names an interface; it is set to loopback while the group is
    created, so that socket is on 127.0.0.1. NCCL reads NCCL_SOCKET_IFNAME when it first
    communicates, so for NCCL it is set to loopback for the rest of the process.
    """
    if backend == "nccl":
        os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    finally:
        if saved is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved

