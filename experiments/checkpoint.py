"""Per-worker checkpoints of one (arm, seed) job, written atomically, resumed from the newest complete set.

Each worker writes ``step{S}.rank{R}.pt`` (model, optimizer state with its error-feedback buffers,
progress counters). A step's set is usable only when every rank's file is there. Rank 0 deletes
sets older than the previous one: by the time it writes step S, every rank has passed the
collectives after the previous checkpoint, so that set is complete and the older ones are not needed.
A file that cannot be resumed from (damaged, or another arm's) raises ``CheckpointError`` naming it;
nothing is deleted to get past it: the message says which files to move away.

A sharded (hybrid) model's step goes through torch.distributed.checkpoint (``sharded_checkpoint.py``):
every rank writes its shards into the folder ``step{S}.dcp``, then its own ``step{S}.rank{R}.pt``
with the progress counters, the layout (world size, shard degree) and a checksum of its shards.
DCP returns once its index is written, so a complete set of rank files means a complete folder.
Such a set resumes only on the layout that saved it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from distro_opt.comm.torch_backend import CollectiveError

from .sharded_checkpoint import (
    check_layout, checksum, is_sharded_model, load_sharded, save_sharded, saved_shapes, shard_degree_of,
)

_NAME = re.compile(r"step(\d+)\.rank(\d+)\.pt$")
_KEYS = {"progress", "model", "optimizer"}
_SHARDED_KEYS = {"progress", "sharded"}
_MAX_DETAIL = 160  # characters of the underlying error quoted in a one-line message


class CheckpointError(ValueError):
    """A checkpoint ``--resume`` cannot continue from; the message names the file and the way out."""


def _detail(exc: BaseException) -> str:
    """An exception as a short single line: torch's messages run over several lines and paragraphs."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 3] + "..."


class CheckpointStore:
    def __init__(self, out: Path, slug: str, seed: int, world_size: int):
        self.dir = Path(out) / "checkpoints" / f"{slug}-seed{seed}"
        self.world_size = world_size

    def _path(self, step: int, rank: int) -> Path:
        return self.dir / f"step{step}.rank{rank}.pt"

    def _sharded_dir(self, step: int) -> Path:
        return self.dir / f"step{step}.dcp"

    def complete_steps(self) -> list[int]:
        """Steps for which every rank's file exists, newest first."""
        if not self.dir.is_dir():
            return []
        ranks: dict[int, set[int]] = {}
        for f in self.dir.iterdir():
            if m := _NAME.match(f.name):
                ranks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        return sorted((s for s, r in ranks.items() if r >= set(range(self.world_size))), reverse=True)

    def latest_step(self) -> int:
        steps = self.complete_steps()
        return steps[0] if steps else 0

    def save(self, rank: int, step: int, model, opt, progress: dict) -> None:
        """Write ``rank``'s checkpoint of ``step``; a sharded model's on every rank at once."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self._path(step, rank)
        if is_sharded_model(model):
            save_sharded(self._sharded_dir(step), model, opt)  # before any rank file names it complete
            layout = {"world_size": self.world_size, "shard_degree": shard_degree_of(model),
                      "params": checksum(model.state_dict())}
            saved = {"progress": dict(progress), "sharded": layout}
        else:
            saved = {"progress": dict(progress), "model": model.state_dict(), "optimizer": opt.state_dict()}
        tmp = path.with_suffix(".tmp")
        torch.save(saved, tmp)
        os.replace(tmp, path)  # a kill mid-write leaves the previous checkpoint intact
        if rank == 0:
            older = [s for s in self.complete_steps() if s < step]
            for s in older[1:]:
                for r in range(self.world_size):
                    self._path(s, r).unlink(missing_ok=True)
                shutil.rmtree(self._sharded_dir(s), ignore_errors=True)

    def restore(self, step: int, rank: int, model, opt) -> dict:
        """Load ``rank``'s checkpoint of ``step`` into ``model`` and ``opt``; return its progress counters.

        torch's ``load_state_dict`` takes the saved param_groups as they are, so another optimizer's
        file (an AdamW checkpoint in DisTrOAdamW's folder) loads silently and the first step fails
        on a missing hyperparameter (KeyError: 'compression_topk'): the names are compared here.
        """
        saved = self._load(step, rank)
        self._check_layout(step, rank, saved, shard_degree_of(model))
        expected = {k for g in opt.param_groups for k in g}
        try:
            if "sharded" in saved:
                load_sharded(self._sharded_dir(step), model, opt)
            else:
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["optimizer"])
        except CollectiveError:  # a peer lost in a sharded load: not this file's fault
            raise
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise self._error(step, rank, f"does not fit this model and optimizer ({_detail(exc)})") from None
        loaded = {k for g in opt.param_groups for k in g}
        if loaded != expected:
            differ = {"missing": expected - loaded, "unexpected": loaded - expected}
            names = "; ".join(f"{what}: {', '.join(sorted(k))}" for what, k in differ.items() if k)
            raise self._error(step, rank, f"holds another optimizer's state (hyperparameters {names})")
        return saved["progress"]

    def _load(self, step: int, rank: int) -> dict:
        """Rank's file of ``step``, once it is known to be this runner's checkpoint of that step."""
        try:
            saved = torch.load(self._path(step, rank), map_location="cpu", weights_only=False)
        except Exception as exc:  # whatever the zip reader or the unpickler met (or an OSError)
            raise self._error(step, rank, f"is unreadable ({_detail(exc)})") from None
        keys = saved.keys() if isinstance(saved, dict) else set()
        if not ((_KEYS <= keys or _SHARDED_KEYS <= keys) and isinstance(saved["progress"], dict)):
            raise self._error(step, rank, "is not a checkpoint of this runner")
        if saved["progress"].get("step") != step:
            raise self._error(step, rank, f"holds step {saved['progress'].get('step')!r}, not step {step}")
        return saved

    def _check_layout(self, step: int, rank: int, saved: dict, shard_degree: int) -> None:
        """``CheckpointError`` unless ``saved`` (rank's file of ``step``) is of this run's layout."""
        layout = saved.get("sharded") or {"world_size": self.world_size, "shard_degree": 1}
        try:
            check_layout(f"checkpoint {self._path(step, rank)}", (layout["world_size"], layout["shard_degree"]),
                         (self.world_size, shard_degree))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None

    def check_sharded(self, shard_degree: int, shapes) -> None:
        """Before a hybrid run resumes, on one rank and with no collective: the newest complete set's
        rank files are this runner's, of this layout, ranks holding the same shard saved the same
        parameters (DCP keeps one copy of them: replicas that had drifted apart would not be
        seen after the load), and the DCP index holds every parameter of ``shapes`` ((name,
        shape) pairs, ``model.parameter_shapes``) at its whole shape."""
        step = self.latest_step()
        if step == 0:
            return
        sums = []
        for rank in range(self.world_size):
            saved = self._load(step, rank)
            self._check_layout(step, rank, saved, shard_degree)
            sums.append(saved["sharded"]["params"])
        for rank, params in enumerate(sums):
            if params != sums[rank % shard_degree]:
                raise self._error(step, rank, f"holds other parameters than rank {rank % shard_degree}, "
                                              "which holds the same shard of another replica")
        try:
            held = saved_shapes(self._sharded_dir(step))
        except ValueError as exc:
            raise self._error(step, 0, str(exc), named=self._sharded_dir(step)) from None
        for name, shape in shapes:
            if held.get(name) != tuple(shape):
                raise self._error(step, 0, f"holds {name} of shape {held.get(name)}, not this model's "
                                           f"{tuple(shape)}", named=self._sharded_dir(step))

    def _error(self, step: int, rank: int, problem: str, named: Path | None = None) -> CheckpointError:
        """Name the file (``named``, else rank's file of ``step``) and the problem, and the way out
        that deletes nothing: set this step aside."""
        earlier = [s for s in self.complete_steps() if s < step]
        then = f"resume from step {earlier[0]}" if earlier else "start this arm over"
        return CheckpointError(
            f"checkpoint {named or self._path(step, rank)} {problem}; move the step{step}.rank*.pt files out of "
            f"{self.dir} to {then}"
        )
