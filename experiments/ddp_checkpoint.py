"""train_ddp's checkpoints: one file per rank, written whole or not at all, and resumed only as a set
that a single save wrote (on any world size). A hybrid run's rank files hold its step and layout,
and name the folder beside them where torch.distributed.checkpoint wrote the model and optimizer
(``sharded_checkpoint.py``); such a set resumes on the world size and shard degree that saved it."""
from __future__ import annotations

import errno
import os
import secrets
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from .sharded_checkpoint import (
    METADATA_NAME, check_layout, checksum, load_sharded, read_index, save_sharded, shard_degree_of,
)

try:
    import fcntl
except ImportError:  # not POSIX: leftovers of killed saves are not cleaned up
    fcntl = None

# os.link's errors on a file system without hard links (FAT/exFAT, most FUSE object-store mounts,
# SMB without unix extensions): the save falls back to a rename
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EXDEV, errno.EMLINK}


def check_save_dir(directory: str) -> None:
    """A save needs a directory that holds no checkpoint (adding rank files to another save's would
    mix two saves, and replacing them, one file at a time, could too) and where a save works: this
    writes, names and deletes a probe file the way save_checkpoint does. Leftovers of a killed save
    (``.rank*.pt.*.part``; a sharded save's folder and its lock file) are deleted."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    held = sorted(f.name for f in path.glob("rank*.pt"))
    if held:
        raise FileExistsError(f"--save-dir {directory} already holds a checkpoint ({', '.join(held)}); "
                              "choose an empty directory (a checkpoint is never overwritten)")
    _remove_leftovers(path)
    probe = None
    try:
        probe, f = _part_file(path, ".probe")
        with f:
            f.write(b"probe")
            _publish(probe, probe.with_suffix(".named.part"))
    except OSError as exc:  # the same type (PermissionError, ...), one line
        raise type(exc)(f"--save-dir {directory} cannot hold a checkpoint: writing a file there failed "
                        f"({exc.strerror or exc})") from None
    finally:
        if probe is not None:
            probe.unlink(missing_ok=True)
            probe.with_suffix(".named.part").unlink(missing_ok=True)


def save_checkpoint(directory: str, rank: int, world_size: int, step: int, model, opt) -> Path:
    """Write ``directory/rank{rank}.pt``, whole or not at all; refuse to overwrite an existing one."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "world_size": world_size, "step": step}
    return _write_rank_file(directory, rank, state)


def save_sharded_checkpoint(directory: str, rank: int, world_size: int, step: int, model, opt) -> Path:
    """A hybrid run's save, on every rank at once: the model and optimizer through DCP into a new
    folder ``directory/sharded-{random}`` (rank 0 names it: no other save writes there), then each
    rank's ``rank{rank}.pt`` naming it, with the step and layout. DCP returns once its index is
    written, so a save cut short leaves no rank file: no checkpoint, only a folder nothing names.

    Rank 0 holds the folder's lock file ``.sharded.{random}.part`` locked from before the folder
    exists until its own rank file names it, and deletes it then: a lock file nobody holds marks
    the folder of a killed or failed save, which the next ``check_save_dir`` there deletes."""
    lock = None
    if dist.get_rank() == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        lock_path, lock = _part_file(Path(directory), _SHARDED_LOCK)
    folder = [_sharded_folder(lock_path) if lock is not None else None]
    dist.broadcast_object_list(folder, src=0)
    save_sharded(Path(directory) / folder[0], model, opt)
    state = {"sharded": folder[0], "shard_degree": shard_degree_of(model), "world_size": world_size, "step": step}
    path = _write_rank_file(directory, rank, state)
    if lock is not None:  # a save that failed keeps its lock file (unlocked once the process ends)
        lock_path.unlink()
        lock.close()
    return path


_SHARDED_LOCK = ".sharded"  # a sharded save's lock file: .sharded.{random}.part, for sharded-{random}/


def _sharded_folder(lock_path: Path) -> str:
    return "sharded-" + lock_path.name.removeprefix(_SHARDED_LOCK + ".").removesuffix(".part")


def _write_rank_file(directory: str, rank: int, state: dict) -> Path:
    path = Path(directory) / f"rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    part, f = _part_file(path.parent, f".{path.name}")  # not rank*.pt: never read as one
    try:
        with f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
            _publish(part, path)  # while the file is still locked: check_save_dir leaves it alone
    finally:
        part.unlink(missing_ok=True)
    return path


def _part_file(directory: Path, stem: str):
    """A new file ``directory/{stem}.{random}.part``, opened for writing and locked (fcntl.flock) until
    closed: a file of this kind that is not locked is a leftover of a killed save. Returns (path, file).

    Between the file's creation and its lock, a concurrent ``_remove_leftovers`` (another rank's
    check_save_dir in the same directory) takes it for a leftover: it may hold the lock at that
    instant, or have deleted the file already. Once this process holds the lock and the name still
    leads to its file, no cleanup can delete it (a cleanup deletes only what it holds locked); until
    then, it starts again under a fresh name. That ends: a cleanup lists the directory once, and
    holds at most one of these files in its list (each is gone before the next is created), so each
    concurrent cleanup makes at most one attempt fail."""
    while True:
        part = directory / f"{stem}.{secrets.token_hex(8)}.part"
        f = open(part, "xb")
        if _lock(f) and _names(part, f):
            return part, f
        f.close()
        part.unlink(missing_ok=True)  # this file's name, or none: the cleanup holding it deletes it too


def _lock(f) -> bool:
    """Lock ``f`` for as long as it is open; False where another process holds it (a cleanup)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # no locks on this file system: leftovers are not told apart, nor deleted
        pass
    return True


def _names(path: Path, f) -> bool:
    """Whether ``path`` is still a name of the open file ``f`` (not deleted, nor replaced)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(f.fileno())
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _publish(part: Path, path: Path) -> None:
    """Give the complete file ``part`` the name ``path``, which must not exist (FileExistsError).
    A hard link does it atomically. Where the file system has none, a rename does it after checking
    that the name is free: a file another process creates at that name in between (a second save
    into the same directory at the same instant) would be replaced."""
    try:
        os.link(part, path)
        return
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
    if os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
    os.rename(part, path)


def _remove_leftovers(directory: Path) -> None:
    """Delete the part files of saves that were killed: those no process holds locked; and with a
    sharded save's lock file, the DCP folder it stands for, unless a rank file is there (its save
    got as far as naming it)."""
    if fcntl is None:
        return
    parts = [*directory.glob(".rank*.pt.*.part"), *directory.glob(".probe.*.part")]
    for part in [*parts, *directory.glob(f"{_SHARDED_LOCK}.*.part")]:
        try:
            with open(part, "rb") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a save writes it
                if part not in parts:
                    if any(directory.glob("rank*.pt")):
                        continue
                    shutil.rmtree(directory / _sharded_folder(part), ignore_errors=True)
                part.unlink(missing_ok=True)
        except OSError:
            continue


def load_checkpoint(directory: str, rank: int, world_size: int, model, opt) -> int:
    """Resume rank ``rank`` of ``world_size`` from checkpoints saved by any world size; return the step.

    Parameters and the Adam-like state are identical on every saving rank (every rank applies the
    same aggregate), so any file serves them. Only the error-feedback buffer ``delta`` is a rank's
    own: what it computed but did not send yet. A rank that existed before resumes with its own
    file; a new rank takes rank 0's file with ``delta`` zeroed (it has sent nothing; copying rank 0's
    residual would send it twice). When shrinking, the residuals of the removed ranks are dropped
    (a warning says so): a small loss of not-yet-sent momentum, not an inconsistency.

    A sharded set (``save_sharded_checkpoint``) loads on every rank together, into a model sharded
    as the saving one was: the same world size and shard degree, else a one-line ``ValueError``.
    """
    saved_ws, saved_degree = check_checkpoint_set(directory)
    check_layout(f"checkpoint {directory!r}", (saved_ws, saved_degree), (world_size, shard_degree_of(model)))
    own = Path(directory) / f"rank{rank if rank < saved_ws else 0}.pt"
    state = torch.load(own, map_location="cpu", weights_only=False)
    if "sharded" in state:
        load_sharded(Path(directory) / state["sharded"], model, opt)
        return state["step"]
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if rank >= saved_ws:
        for s in opt.state.values():
            if "delta" in s:
                s["delta"].zero_()
    if rank == 0 and saved_ws > world_size:
        warnings.warn(f"resuming {saved_ws} ranks as {world_size}: the unsent residual momentum of ranks "
                      f"{world_size}..{saved_ws - 1} is dropped")
    return state["step"]


def check_checkpoint_set(directory: str) -> tuple[int, int]:
    """The (world size, shard degree) that saved ``directory``, after checking that its rank files
    are one save's: the same step, world size and parameters (every saving rank holds the same
    parameters; a sharded save's files name the same DCP folder, whose index is there), and one
    file per rank. Rank files of different saves would make the ranks diverge silently."""
    files = sorted(Path(directory).glob("rank*.pt"))
    if not files:
        raise FileNotFoundError(f"No checkpoint files rank*.pt in {directory!r}")
    saves = {}
    for f in files:
        try:
            state = torch.load(f, map_location="cpu", weights_only=False)
            saves[f.name] = (state["step"], state["world_size"], state.get("shard_degree", 1),
                             state.get("sharded") or checksum(state["model"]))
        except Exception as exc:  # noqa: BLE001 - torn or foreign file: torch raises many types
            raise ValueError(f"Checkpoint file {f} cannot be read ({type(exc).__name__}: {exc})") from None
    _, saved_ws, saved_degree, data = saves[files[0].name]
    if len(files) != saved_ws:
        raise ValueError(f"Checkpoint {directory!r} is incomplete: {len(files)} of {saved_ws} rank files")
    if len(set(saves.values())) > 1 or set(saves) != {f"rank{r}.pt" for r in range(saved_ws)}:
        seen = ", ".join(f"{name} (step {s}, {w} ranks, params {c})" if d == 1 else
                         f"{name} (step {s}, {w} ranks at shard degree {d}, data {c})"
                         for name, (s, w, d, c) in saves.items())
        raise ValueError(f"Checkpoint files in {directory!r} are not from one save: {seen}; "
                         "resume from a directory that a single save wrote")
    if saved_degree > 1:
        if not (Path(directory) / data / METADATA_NAME).is_file():
            raise ValueError(f"Checkpoint {directory!r} is incomplete: its rank files name {data}, "
                             f"which holds no {METADATA_NAME}")
        try:
            read_index(Path(directory) / data)
        except ValueError as exc:
            raise ValueError(f"Checkpoint {directory!r} cannot be resumed: {data} {exc}") from None
    return saved_ws, saved_degree
