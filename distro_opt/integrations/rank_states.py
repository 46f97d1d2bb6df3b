"""Each rank's optimizer state beside a tool's checkpoint (transformers' Trainer, accelerate).

Those tools save the optimizer of rank 0 alone (``optimizer.pt``, ``optimizer.bin``) and load that
file on every rank: right for torch's optimizers, whose state is the same on every rank, but each
DisTrOAdamW worker's error feedback is its own (what it has not sent yet), so a resume from rank 0's
state alone is silently inexact. Beside the tool's files, in the same folder:

* ``{name}-rank{r}.pt`` for every rank r > 0: that rank's state (rank 0's is the tool's file);
* ``MANIFEST`` (written by rank 0): the world size that saved them.

Before anything is loaded every rank checks the same things (``check``), so that all refuse alike:
a checkpoint saved by another number of ranks, one without per-rank state saved by several ranks
(or by a tool alone), or one missing a rank's file (a save that did not finish). The folder must
be one that every rank reads and writes (a shared filesystem on several machines).
"""
from __future__ import annotations

import json
import os

import torch

MANIFEST = "distro-opt-ranks.json"


def rank_file(directory, name: str, rank: int) -> str:
    return os.path.join(directory, f"{name}-rank{rank}.pt")


def _save_atomically(obj, path: str, write) -> None:
    """Written beside ``path`` and renamed over it: a save cut short leaves no partial file."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(obj, tmp)
    os.replace(tmp, path)


def save(directory, state, rank: int, world_size: int, name: str) -> None:
    """This rank's part: ``state`` to its own file (ranks > 0), the manifest (rank 0)."""
    os.makedirs(directory, exist_ok=True)
    if rank > 0:
        _save_atomically(state, rank_file(directory, name, rank), torch.save)
    else:
        manifest = {"world_size": world_size, "files": f"{name}-rank{{r}}.pt for ranks 1..{world_size - 1}"}

        def write(obj, path):
            with open(path, "w") as f:
                json.dump(obj, f)

        _save_atomically(manifest, os.path.join(directory, MANIFEST), write)


def check(directory, world_size: int, name: str, saved_by: str) -> None:
    """Refuse (``ValueError``, the same on every rank) a checkpoint this world cannot resume exactly.
    ``saved_by`` names the tool's own optimizer file, for the messages."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        if world_size == 1:
            return  # one rank: the tool's file is the whole state
        raise ValueError(
            f"distro-opt: checkpoint {directory} has no per-rank optimizer state ({MANIFEST} is missing): "
            f"{saved_by} holds rank 0's alone, and resuming the other {world_size - 1} ranks from it "
            "would replace each one's error feedback with rank 0's. Resume from a checkpoint saved with "
            "distro-opt's per-rank state (docs/integrations.md), or delete the optimizer file to start "
            "the optimizer afresh."
        )
    with open(path) as f:
        saved = json.load(f)
    saved_world = saved.get("world_size") if isinstance(saved, dict) else None
    if saved_world != world_size:
        raise ValueError(
            f"distro-opt: checkpoint {directory} holds the optimizer state of {saved_world} ranks, and "
            f"this run has {world_size}: each rank's error feedback is its own, and there is no exact "
            f"way to map {saved_world} ranks' onto {world_size}. Resume with {saved_world} ranks, or "
            "delete the optimizer files to start the optimizer afresh."
        )
    missing = [r for r in range(1, world_size) if not os.path.isfile(rank_file(directory, name, r))]
    if missing:
        raise ValueError(
            f"distro-opt: checkpoint {directory} lacks the optimizer state of rank(s) "
            f"{', '.join(map(str, missing))} ({os.path.basename(rank_file(directory, name, missing[0]))}): "
            "the save did not finish on every rank. Resume from an earlier checkpoint."
        )


def load(directory, rank: int, name: str):
    """This rank's saved state (None on rank 0, whose state is the tool's file)."""
    if rank == 0:
        return None
    return torch.load(rank_file(directory, name, rank), map_location="cpu", weights_only=True)
