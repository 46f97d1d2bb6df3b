"""Per-worker checkpoints of one (arm, seed) job, written atomically, resumed from the newest complete set.

Each worker writes ``step{S}.rank{R}.pt`` (model, optimizer state with its error-feedback buffers,
progress counters). A step's set is usable only when every rank's file is there. Rank 0 deletes
sets older than the previous one: by the time it writes step S, every rank has passed the
collectives after the previous checkpoint, so that set is complete and the older ones are not needed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

_NAME = re.compile(r"step(\d+)\.rank(\d+)\.pt$")


class CheckpointStore:
    def __init__(self, out: Path, slug: str, seed: int, world_size: int):
        self.dir = Path(out) / "checkpoints" / f"{slug}-seed{seed}"
        self.world_size = world_size

    def _path(self, step: int, rank: int) -> Path:
        return self.dir / f"step{step}.rank{rank}.pt"

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
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self._path(step, rank)
        tmp = path.with_suffix(".tmp")
        torch.save(
            {"progress": dict(progress), "model": model.state_dict(), "optimizer": opt.state_dict()}, tmp
        )
        os.replace(tmp, path)  # a kill mid-write leaves the previous checkpoint intact
        if rank == 0:
            older = [s for s in self.complete_steps() if s < step]
            for s in older[1:]:
                for r in range(self.world_size):
                    self._path(s, r).unlink(missing_ok=True)

    def load_latest(self, rank: int) -> dict | None:
        """This rank's state at the newest step every rank saved, or None when there is none."""
        step = self.latest_step()
        if step == 0:
            return None
        return torch.load(self._path(step, rank), map_location="cpu", weights_only=False)
