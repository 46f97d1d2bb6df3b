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
(``remove_rendezvous_file``), unless another job has put its own file at the path meanwhile. Once
the group exists they end through ``end_process``: the file deleted, output flushed, the group
destroyed where no collective can be in flight, and no interpreter finalization (where Gloo can abort).

A process can only be checked from the same PID namespace of the same boot of the kernel: a rank
in another container (same hostname and volume, its own pids) or on another machine (a shared
filesystem) counts as running, so only the timeout rule applies to it.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn

import torch.distributed as dist

RENDEZVOUS_FILE = "DISTRO_OPT_RENDEZVOUS_FILE"
EXIT_PEER_LOST, EXIT_INTERRUPTED = 1, 130  # a peer died, hung or never came (or a bug); Ctrl-C
_PROCESS_KEY = "distro_opt/process/{rank}"  # the record of the rank that joined the file: _this_process
_RECORD_FIELDS = 5  # host pid start-time pid-namespace boot-id


class RendezvousError(RuntimeError):
    """The rendezvous file cannot be used (left over from an earlier job, or RANK/WORLD_SIZE missing)."""


@dataclass(frozen=True)
class RendezvousFile:
    """The rendezvous file a process joined: its path, and the record this process wrote in it,
    which only that file holds (a later job's file at the same path does not; its inode number may
    well be the same, as a file system reuses a deleted file's)."""
    path: Path
    record: str


def start_process_group(backend: str, timeout: datetime.timedelta) -> RendezvousFile | None:
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
    _refuse_unused_file(path, timeout)  # before the FileStore writes to it (a refused file keeps its age)
    store = dist.FileStore(path, world_size)
    store.set_timeout(timeout)
    _refuse_ended_job(store, path, world_size)
    joined = RendezvousFile(Path(path), _this_process())
    store.set(_PROCESS_KEY.format(rank=rank), joined.record)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:
        remove_rendezvous_file(joined)  # this job's file, never to be met in again: do not leave it stale
        raise
    return joined


def remove_rendezvous_file(joined: RendezvousFile | None) -> None:
    """Delete the rendezvous file that start_process_group returned (None: nothing to do), if it is
    still the file at its path. A peer of the same job still using it is harmless: a FileStore that
    writes again recreates the file without process records, which the next job accepts (so it is
    left too). A file that another job has put at the path since (a job restarted while a slow rank
    of the old one was still ending) is that job's, and stays: it does not hold this process's
    record. (Only a file put there between the read and the unlink, microseconds, is not told apart.)"""
    if joined is None:
        return
    try:
        held = joined.path.read_bytes()  # a FileStore stores keys and values as they are
    except OSError:
        return
    if joined.record.encode() in held:
        joined.path.unlink(missing_ok=True)


def run_rank(start: Callable[[], RendezvousFile | None], work: Callable[[], tuple[int, bool]], who: str,
             again: str = "") -> NoReturn:
    """One rank of a job, from its start to its exit. ``start()`` starts the process group and returns
    its rendezvous file (start_process_group); ``work()`` does the rank's work and returns (exit
    code, whether no collective can be in flight, so that the group may be destroyed). The process
    then ends through end_process. Where it ends otherwise, one line on stderr names this rank
    (``who``): the group did not start (a peer never came, its address cannot be reached), 1, with
    ``again`` (what to run next) appended; Ctrl-C, 130; a bug, its traceback and 1. A refused
    rendezvous file (RendezvousError) is raised, before any group exists."""
    try:
        joined = start()
    except RendezvousError:
        raise
    except KeyboardInterrupt:
        print_one_line(f"{who}: interrupted while the ranks met{again}")
        end_process(EXIT_INTERRUPTED, None, destroy_group=False)
    except RuntimeError as exc:  # also no such GPU: the line names it
        print_one_line(f"{who}: the process group did not start ({exc}){again}")
        end_process(EXIT_PEER_LOST, None, destroy_group=False)
    try:
        code, destroy_group = work()
    except KeyboardInterrupt:
        print_one_line(f"{who}: interrupted")
        code, destroy_group = EXIT_INTERRUPTED, False
    except BaseException:  # a bug: its traceback, then the same way out as a broken group
        traceback.print_exc()
        code, destroy_group = EXIT_PEER_LOST, False
    end_process(code, joined, destroy_group=destroy_group)


def print_one_line(line: str) -> None:
    """``line`` on stderr as one line, even where it quotes a Gloo error of several."""
    print(" ".join(line.split()), file=sys.stderr, flush=True)


def end_process(code: int, joined: RendezvousFile | None, *, destroy_group: bool) -> NoReturn:
    """End this rank's process with exit code ``code``, once its output is flushed and the rendezvous
    file deleted (remove_rendezvous_file). ``destroy_group``: every rank is between collectives (it
    succeeded, or stops on an error all ranks agreed on), so the group is destroyed first; where a
    peer died or hung, or a Ctrl-C came in the middle of a collective, it is abandoned instead, as
    destroying it could wait on a peer that never answers.

    The interpreter's finalization is skipped (``os._exit``): with a Gloo group a rank can abort
    there ("terminate called without an active exception", exit code -6) after its last line, as
    Gloo's threads drop tensors while the interpreter tears down (pytorch/pytorch#179291)."""
    try:
        if destroy_group and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        remove_rendezvous_file(joined)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
                pass
        os._exit(code)


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
    except OSError as exc:
        raise RendezvousError(f"rendezvous file {path} cannot be read ({exc.strerror or exc})") from None
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
        if _has_ended(record):
            parts = _fields(record)
            if parts is None:
                raise _stale(path, f"its rank {rank} record {record!r} is not one this version writes")
            raise _stale(path, f"its rank {rank} was process {parts[1]} on {parts[0]}, which has ended")


def _this_process() -> str:
    return " ".join((socket.gethostname(), str(os.getpid()), _start_time("self"), *_pid_space()))


def _pid_space() -> tuple[str, str]:
    """(PID namespace, boot id) of this process: where its pids mean the same processes ("-": unknown).
    The namespace is unknown also where /proc belongs to another one (pids could not be looked up)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
        if os.readlink("/proc/self") != str(os.getpid()):
            namespace = "-"
    except OSError:
        namespace = "-"
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip() or "-"
    except OSError:
        boot = "-"
    return namespace.replace(" ", "_"), boot.replace(" ", "_")


def _start_time(pid) -> str:
    """When process ``pid`` started (Linux: clock ticks since boot), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "-"
    return stat[stat.rindex(")") + 2:].split()[19]  # field 22 of proc_pid_stat(5)


def _fields(record: str) -> list[str] | None:
    """A record's fields (host, pid, start time, PID namespace, boot id), or None where it is not one
    this version writes (an earlier version's)."""
    parts = record.split()
    return parts if len(parts) == _RECORD_FIELDS and parts[1].isdigit() else None


def _has_ended(record: str) -> bool:
    """Whether the process in ``record`` (from _this_process) has certainly ended. A record of
    another PID namespace or boot (a rank in another container sharing the file, or on another
    machine), or one whose start time cannot be read here (another user's process under
    ``hidepid``), cannot be checked: it counts as running. A record of another shape is an earlier
    version's: ended."""
    parts = _fields(record)
    if parts is None:
        return True
    pid, started, space = int(parts[1]), parts[2], tuple(parts[3:])
    here = _pid_space()
    if "-" in here or space != here:
        return False  # its pid means another process here, or none
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, owned by another user
    now = _start_time(pid)
    return "-" not in (started, now) and now != started  # a different start: the pid was reused


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

