"""What the trimmed-mean aggregate (``distro_opt/robust.py``) costs with no rogue: the experiment
runner's ``smoke`` transformer trained with its ``distro`` arm for 100 steps by N in-process workers,
with DeMo's aggregate and with ``untrusted_fraction=0.25`` (what distro-peer uses in a public run).
Prints the validation loss at step 100 (the runner's own evaluation, on its fixed validation batches).

    .venv/bin/python research/robust_smoke_loss.py     # needs the smoke corpus cache (experiments.prepare)
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from distro_opt.comm import InProcessBackend
from distro_opt.experiments.arms import parse_arms
from distro_opt.experiments.data import load_corpus
from distro_opt.experiments.metrics import MetricsSink
from distro_opt.experiments.presets import get_preset
from distro_opt.experiments.coordination import LossTable
from distro_opt.experiments.train import Job, run_worker

STEPS, SEED = 100, 0


def val_loss(workers: int, untrusted_fraction: float) -> float:
    preset = dataclasses.replace(get_preset("smoke"), steps=STEPS, workers=workers, eval_every=STEPS)
    corpus = load_corpus(preset.corpus, preset.tokenizer, preset.vocab_size)
    arm = parse_arms("distro")[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        job = Job.create(arm, SEED, preset, corpus, out, resume=False)
        sink = MetricsSink(out / "metrics.jsonl", arm.label, SEED, STEPS, start_step=0, progress=False)
        losses = LossTable(preset.timeout_s)

        def worker(backend):
            backend.untrusted_fraction = untrusted_fraction
            return run_worker(backend, job, losses, None, sink if backend.rank == 0 else None)

        try:
            InProcessBackend.run(workers, worker, timeout_s=preset.timeout_s)
        finally:
            sink.close()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None)


def main() -> None:
    print(f"smoke, distro arm, seed {SEED}: validation loss at step {STEPS}")
    print("N | DeMo mean | trimmed 0.25")
    for workers in (4, 8):
        print(f"{workers} | {val_loss(workers, 0.0):.4f} | {val_loss(workers, 0.25):.4f}", flush=True)


if __name__ == "__main__":
    main()
