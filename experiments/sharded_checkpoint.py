"""Checkpoints of a sharded (FSDP2) model and its optimizer through torch.distributed.checkpoint.

A hybrid run (``hybrid.py``) holds each parameter as a DTensor shard; DCP writes every rank's shards
into one directory (one ``.distcp`` file per rank and a ``.metadata`` file, renamed into place last,
once every rank's data is written) and keeps one copy of a tensor that several replicas hold.
``get_state_dict`` / ``set_state_dict`` name the state by the parameters' module paths. DisTrOAdamW
lays each replica's own error-feedback momentum out so that DCP keeps every replica's copy
(``distro_opt.shards.per_replica``); such a checkpoint resumes on the layout that saved it: the same
world size and shard degree, which ``check_layout`` compares before anything loads.

Saving and loading are collectives over the default process group: every rank takes part.
"""
from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import torch

from distro_opt.comm.torch_backend import CollectiveError
from distro_opt.shards import is_sharded, local

METADATA_NAME = ".metadata"  # DCP's index of a complete save


def is_sharded_model(model) -> bool:
    """Whether ``model`` holds DTensor parameters (sharded by FSDP2)."""
    return any(is_sharded(p) for p in model.parameters())


def shard_degree_of(model) -> int:
    """Ranks that share one replica of ``model``: the size of its parameters' mesh (1: unsharded)."""
    sharded = [p for p in model.parameters() if is_sharded(p)]
    return sharded[0].device_mesh.size() if sharded else 1


def check_layout(source: str, saved: tuple[int, int], here: tuple[int, int]) -> None:
    """A one-line ``ValueError`` when ``source``'s (world size, shard degree) is not this run's and
    either is sharded: a plain checkpoint resumes on any world size, a sharded one only on its own."""
    if saved != here and max(saved[1], here[1]) > 1:
        raise ValueError(f"{source} was saved by {layout_text(*saved)}, this run has {layout_text(*here)}: "
                         "a sharded checkpoint resumes only on the world size and shard degree that saved it")


def layout_text(world_size: int, shard_degree: int) -> str:
    return f"{world_size} rank{'s' if world_size != 1 else ''} at shard degree {shard_degree}"


def save_sharded(directory: Path | str, model, opt) -> None:
    """Write ``model``'s and ``opt``'s state into ``directory`` (every rank, collectively). A rank's
    failed write is an ``OSError`` on every rank (DCP gathers every rank's error); a peer lost in
    the save's collectives, ``CollectiveError``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    with _one_line_errors(directory, "written", OSError):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))


def load_sharded(directory: Path | str, model, opt) -> None:
    """Load ``directory`` (written by ``save_sharded``) into ``model`` and ``opt`` (every rank,
    collectively). ``get_state_dict`` of an optimizer with no state yet takes one step at lr 0 on
    zero gradients to create it (DisTrOAdamW's then exchanges a payload), which the load replaces.
    A checkpoint that does not load is a ``ValueError`` on every rank; a peer lost, ``CollectiveError``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    loaded = {"model": model_sd, "optim": optim_sd}
    with _one_line_errors(directory, "loaded", ValueError):
        dcp.load(loaded, checkpoint_id=str(directory))
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])


@contextlib.contextmanager
def _one_line_errors(directory, done: str, error_type):
    """DCP's errors as the runners report them: a ``CheckpointException`` (a BaseException carrying
    each failed rank's error) as one line of ``error_type``; a ``RuntimeError`` out of DCP's own
    collectives (Gloo's, NCCL's) as ``CollectiveError``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        first = next((error for error, _trace in exc.failures.values()), exc)
        raise error_type(f"checkpoint {directory} could not be {done} ({type(first).__name__}: "
                         f"{' '.join(str(first).split())[:160]})") from None
    except RuntimeError as exc:
        raise CollectiveError(f"the collectives of checkpoint {directory} did not complete ({exc}). A peer "
                              "rank probably died or hung; the process group cannot be used any more") from exc


def saved_shapes(directory: Path | str) -> dict[str, tuple[int, ...]]:
    """The whole (unsharded) shape of every model tensor in ``directory``'s DCP index, by name;
    read on one rank, with no collective, once ``read_index`` has checked the data files."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_index(directory)
    return {key.removeprefix("model."): tuple(meta.size) for key, meta in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}


def read_index(directory: Path | str):
    """``directory``'s DCP index, once every data file it points into is there and holds the bytes
    it names: a missing or cut-short file is found on one rank before the load, whose collectives
    would otherwise stop every rank in the middle. A problem is a ``ValueError`` saying what (its
    message names no path: the caller names the checkpoint). Damage that keeps a file's size is
    found by the load itself."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a missing file or whatever the unpickler met
        raise ValueError(f"holds no readable {METADATA_NAME} ({type(exc).__name__})") from None
    ends: dict[str, int] = {}  # each data file's last byte the index points to
    for info in metadata.storage_data.values():  # DCP's _StorageInfo: (relative_path, offset, length)
        name, offset, length = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            ends[name] = max(ends.get(name, 0), offset + length)
    for name, end in sorted(ends.items()):
        try:
            size = (Path(directory) / name).stat().st_size
        except OSError as exc:
            raise ValueError(f"lacks {name}, a data file its {METADATA_NAME} names "
                             f"({exc.strerror or type(exc).__name__})") from None
        if size < end:
            raise ValueError(f"holds {name} cut short ({size:,} of the {end:,} bytes its {METADATA_NAME} names)")
    return metadata


def checksum(params: dict) -> str:
    """A short digest of the exact parameter bits, to compare ranks by eye (of a DTensor, this rank's
    shard: two ranks compare equal when they hold the same shard of the same parameters)."""
    digest = hashlib.sha256()
    for v in params.values():
        digest.update(local(v).detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
