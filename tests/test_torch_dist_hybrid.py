"""Hybrid runs: the model sharded over each replica's ranks (FSDP2), distro-opt between replicas.

A 2 x 2 run (4 real Gloo ranks on 127.0.0.1, --shard-degree 2) against the unsharded 2-process run
(shard degree 1) on the same data: the same train losses, identical replicas of each shard, and
bytes per step that are the local shards' payload. The tiny transformer's parameters have even
first dimensions whose halves are whole chunks (chunk 16), so both runs compress the same
coefficients; what may differ is float rounding (FSDP2's gathered weights and reduce-scattered
gradients sum in another order), which can flip the sign of a near-zero coefficient: a tie.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from distro_opt.comm import CommStats
from distro_opt.experiments.model import parameter_shapes
from distro_opt.experiments.presets import get_preset
from distro_opt.experiments.process_group import one_machine_env
from distro_opt.wire import PayloadLayout, param_spec

from _models import TINY_TRANSFORMER_FLAGS
from _procs import wait_all

STEPS = 4
TOPK, CHUNK = 4, 16
ARMS = f"adamw,distro:chunk={CHUNK},topk={TOPK}"
HEADER_BYTES = 8  # the frame header of TorchDistributedBackend's all-gather (test_torch_backend.py)
# Train losses of the sharded and the unsharded run agree to this (relative): their forward passes
# round differently in float32 (~1e-7), and a sign tie may move one coefficient's update, which
# moves the loss of a few-step run by far less than this.
LOSS_RTOL = 1e-4


def run_args(corpus, out, workers, shard_degree, arms=ARMS, steps=STEPS, extra=()):
    folder, cache = corpus
    return ["--preset", "smoke", "--arms", arms, "--workers", workers, "--shard-degree", shard_degree,
            "--out", out, "--cache", cache, "--corpus", folder, "--tokenizer", "byte",
            *TINY_TRANSFORMER_FLAGS, "--seq-len", "32", "--batch-size", "2", "--steps", steps,
            "--warmup-steps", "1", "--eval-every", "1000", "--eval-batches", "1",
            "--eval-batch-size", "2", "--checkpoint-every", "2", "--no-progress", "--no-plots",
            "--timeout-s", "30", *extra]


def launch(tmp_path, args, world_size, timeout_s=90):
    """``experiments.run`` on ``world_size`` ranks; [(exit code, stderr)] of each."""
    rendezvous = tmp_path / f"rendezvous-{world_size}"
    procs = [subprocess.Popen([sys.executable, "-m", "distro_opt.experiments.run", *map(str, args)],
                              cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                 **one_machine_env(rank, world_size, rendezvous)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank in range(world_size)]
    return wait_all(procs, timeout_s)


def train_losses(out):
    """{arm label: [train loss of steps 1..]} from a run's metrics."""
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] > 0:
            losses.setdefault(row["arm"], []).append(row["train_loss"])
    return losses


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """(the hybrid 2 x 2 run's --out, the unsharded 2-worker run's --out)."""
    tmp = tmp_path_factory.mktemp("hybrid")
    outs = tmp / "hybrid", tmp / "plain"
    for out, world, shard in ((outs[0], 4, 2), (outs[1], 2, 1)):
        for code, err in launch(tmp, run_args(corpus, out, 2, shard), world):
            assert code == 0, err
    return outs


def test_hybrid_losses_equal_the_unsharded_runs(runs):
    hybrid, plain = map(train_losses, runs)
    assert sorted(hybrid) == sorted(plain) and len(hybrid) == 2
    for arm in plain:
        assert len(hybrid[arm]) == STEPS
        assert hybrid[arm] == pytest.approx(plain[arm], rel=LOSS_RTOL), arm


def _checkpoint(out, arm_slug, rank):
    """The model of ``rank``'s step-2 checkpoint, as local shards."""
    saved = torch.load(out / "checkpoints" / f"{arm_slug}-seed0" / f"step2.rank{rank}.pt",
                       map_location="cpu", weights_only=False)
    return {k: getattr(v, "_local_tensor", v) for k, v in saved["model"].items()}


def test_ranks_holding_the_same_shard_hold_bitwise_identical_replicas(runs):
    hybrid, _ = runs
    folders = sorted(p.name.removesuffix("-seed0") for p in (hybrid / "checkpoints").iterdir())
    assert len(folders) == 2
    for slug in folders:
        ranks = [_checkpoint(hybrid, slug, r) for r in range(4)]
        for shard in (0, 1):  # ranks 0, 2 hold shard 0 (replicas 0, 1); ranks 1, 3 shard 1
            a, b = ranks[shard], ranks[shard + 2]
            assert all(torch.equal(a[k], b[k]) for k in a), (slug, shard)
        assert not torch.equal(ranks[0]["embed.weight"], ranks[1]["embed.weight"])


def _result(out, kind):
    return next(json.loads(p.read_text()) for p in (out / "results").glob("*.json")
                if json.loads(p.read_text())["kind"] == kind)


def test_hybrid_bytes_per_step_are_the_local_shards_payload(runs, corpus):
    hybrid, plain = runs
    preset = get_preset("smoke")
    config = json.loads((hybrid / "config.json").read_text())
    shapes = parameter_shapes(type(preset)(**config["preset"]).model_config(config["vocab_size"]))
    local = [(s[0] // 2, *s[1:]) for _, s in shapes]  # FSDP2 halves the first dimension
    layout = PayloadLayout([param_spec(shape, TOPK, CHUNK, 1) for shape in local])
    distro = _result(hybrid, "distro")
    assert distro["payload_nbytes"] == layout.nbytes
    assert distro["world_size"] == 2  # the replicate group: shard ranks exchange no payload
    assert layout.nbytes < _result(plain, "distro")["payload_nbytes"]
    rows = [json.loads(line) for line in (hybrid / "metrics.jsonl").read_text().splitlines()]
    per_step = [r["sent_bytes"] for r in rows if r["arm"] == distro["arm"] and r["step"] > 1]
    assert per_step == [CommStats.all_gather_bytes(HEADER_BYTES + layout.nbytes, 2)] * (STEPS - 1)
    adamw = _result(hybrid, "adamw")  # the gradient all-reduce: the local shards' fp32 gradients
    assert adamw["payload_nbytes"] == 4 * sum(torch.Size(s).numel() for s in local)
