"""The run directory ``--out``: which run it holds (config.json), and the refusals that keep two runs
from mixing there: a new run needs it empty or absent, ``--resume`` needs the same run in it, and
a run in progress holds its lock."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from distro_opt.cli_args import UsageError

from .files import LOCK_NAME, lock_directory, write_atomic
from .metrics import read_metrics
from .presets import Preset, saved_preset_fields
from .sharded_checkpoint import layout_text

_NOT_IDENTITY = ("torch_threads", "timeout_s")  # how a run executes, not what it measures
_CONFIG_KEYS = ("arms", "seeds", "workers", "vocab_size")  # besides "preset"


def run_config(preset: Preset, arms, workers: int, vocab_size: int) -> dict:
    return {
        "preset": dataclasses.asdict(preset),
        "arms": [dataclasses.asdict(a) for a in arms],
        "seeds": preset.seed_list(),
        "workers": workers,
        "vocab_size": vocab_size,
    }


def _identity(config: dict) -> dict:
    ident = json.loads(json.dumps(config))
    ident["preset"] = saved_preset_fields(ident["preset"])
    for k in _NOT_IDENTITY:
        ident["preset"].pop(k, None)
    return ident


def _read_config(cfg_path: Path) -> dict:
    """A saved config.json, or UsageError when it is not one (unreadable, or another shape)."""
    try:
        config = json.loads(cfg_path.read_text())
    except ValueError:
        config = None
    if not (
        isinstance(config, dict)
        and isinstance(config.get("preset"), dict)
        and all(k in config for k in _CONFIG_KEYS)
    ):
        raise UsageError(
            f"{cfg_path.parent} holds an unreadable config.json (not a run's configuration); "
            "choose another --out"
        )
    return config


def prepare_out_dir(out: Path, config: dict, resume: bool):
    """Refuse to mix runs: a new run needs an empty or absent --out; --resume needs the same run there,
    with readable metrics. Returns the lock on --out (``lock_directory``; close it when the run ends):
    a second run in the same directory, started while this one runs, is refused instead of writing
    into its files."""
    cfg_path = out / "config.json"
    if out.exists() and (not out.is_dir() or not cfg_path.exists() and _holds_files(out)):
        raise UsageError(f"{out} exists and is not an empty directory; choose another --out")
    if resume and not cfg_path.exists():
        raise UsageError(f"nothing to resume: {out} holds no run")
    out.mkdir(parents=True, exist_ok=True)
    try:
        lock = lock_directory(out)
    except BlockingIOError:
        raise UsageError(
            f"{out} is in use by another run; wait for it to end, or choose another --out"
        ) from None
    try:
        _check_or_start(out, cfg_path, config, resume)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    return lock


def _layouts(saved: dict, here: dict) -> str:
    """Where the runs differ in how their ranks are laid out: both layouts (a hybrid run's checkpoints
    resume only on their own), else nothing."""
    layout = [(c["workers"] * c["preset"].get("shard_degree", 1), c["preset"].get("shard_degree", 1))
              for c in (saved, here)]
    if layout[0] == layout[1]:
        return ""
    return f"; it was saved by {layout_text(*layout[0])}, this run has {layout_text(*layout[1])}"


def _holds_files(out: Path) -> bool:
    return any(f.name != LOCK_NAME for f in out.iterdir())


def _check_or_start(out: Path, cfg_path: Path, config: dict, resume: bool) -> None:
    """Under the lock: the run in --out must be this one (resume), or --out must still be empty."""
    if cfg_path.exists():
        old = _read_config(cfg_path)
        if not resume:
            raise UsageError(
                f"{out} already holds a run; pass --resume to continue it, or choose another --out"
            )
        a, b = _identity(old), _identity(config)
        if a != b:
            diff = sorted(
                k for k in set(a["preset"]) | set(b["preset"]) if a["preset"].get(k) != b["preset"].get(k)
            )
            diff += [k for k in _CONFIG_KEYS if a[k] != b[k] and k not in diff]  # workers: both places
            raise UsageError(
                f"{out} holds a different run (differs in: {', '.join(diff)}{_layouts(a, b)}); "
                "choose another --out"
            )
        read_metrics(out / "metrics.jsonl")  # damaged rows: refused now, naming the file, not mid-run
        return
    if resume:
        raise UsageError(f"nothing to resume: {out} holds no run")
    if _holds_files(out):
        raise UsageError(f"{out} exists and is not an empty directory; choose another --out")
    (out / "results").mkdir()
    write_atomic(cfg_path, json.dumps(config, indent=1))
