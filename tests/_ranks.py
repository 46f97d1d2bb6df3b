"""Test helper: real ranks as subprocesses, each bounded by a wall-clock timeout, their rendezvous in
a file (``one_machine_env``: no TCP store). ``launch`` runs ranks of ``_dist_worker.py`` (or another
rank script) and reads what each saved; ``start_ranks`` starts ranks of ``experiments.run``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distro_opt.experiments.process_group import one_machine_env

from _models import TINY_TRANSFORMER_FLAGS
from _procs import default_sigint

WORKER = Path(__file__).with_name("_dist_worker.py")
HEADER_BYTES = 8


def launch(jobs, world_size, tmp_path, timeout_s=60.0, wait_ranks=None, dist_backend="gloo", worker=WORKER):
    """Run ``world_size`` ranks doing ``jobs`` ([name, scenario, args] each, in order); wait for
    ``wait_ranks`` (default all) and kill the rest. Returns ``(results, returncodes)``: results[r] is
    what rank r saved, ``{name: result}`` (None if it saved nothing). ``worker``: the script each rank
    runs (tests/comm/test_torch_backend.py runs as one for the scenarios at its end)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TEST_DIST_BACKEND=dist_backend)
    procs, logs = [], []
    try:
        for r in range(world_size):
            log = open(tmp_path / f"log{r}.txt", "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(worker), str(tmp_path), json.dumps(jobs, default=str)],
                env={**env, **one_machine_env(r, world_size, tmp_path / "rendezvous")},  # no TCP store
                stdout=log, stderr=subprocess.STDOUT,
            ))
        deadline = time.monotonic() + timeout_s
        for r in (range(world_size) if wait_ranks is None else wait_ranks):
            try:
                procs[r].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still running after {timeout_s} s:\n{read_logs(tmp_path, world_size)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for log in logs:
            log.close()
    results = []
    for r in range(world_size):
        path = tmp_path / f"rank{r}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return results, [p.returncode for p in procs]


def read_logs(tmp_path, world_size) -> str:
    return "\n".join(f"--- rank {r}\n" + (tmp_path / f"log{r}.txt").read_text() for r in range(world_size))


def expect_success(results, codes, tmp_path):
    assert codes == [0] * len(codes), read_logs(tmp_path, len(codes))
    return results



def run_args(corpus, out, cache=None, steps=4, arms="distro"):
    folder, prepared = corpus
    return ["--preset", "smoke", "--arms", arms, "--workers", "2", "--out", out,
            "--cache", cache or prepared, "--corpus", folder, "--tokenizer", "byte",
            *TINY_TRANSFORMER_FLAGS, "--seq-len", "32",
            "--batch-size", "2", "--steps", steps, "--warmup-steps", "1", "--eval-every", "1000",
            "--eval-batches", "1", "--eval-batch-size", "2", "--checkpoint-every", "1000",
            "--no-progress", "--no-plots", "--timeout-s", "20"]


def start_ranks(tmp_path, rank_args, rendezvous):
    return [subprocess.Popen([sys.executable, "-m", "distro_opt.experiments.run", *map(str, args)],
                             cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                **one_machine_env(rank, 2, rendezvous)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             preexec_fn=default_sigint)
            for rank, args in enumerate(rank_args)]
