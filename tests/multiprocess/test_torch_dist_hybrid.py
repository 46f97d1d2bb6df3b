"""Hybrid runs: the model sharded over each replica's ranks (FSDP2), distro-opt between replicas.

A 2 x 2 run (4 real Gloo ranks on 127.0.0.1, --shard-degree 2) against the unsharded 2-process run
(shard degree 1) on the same data: the same train losses, identical replicas of each shard, and
bytes per step that are the local shards' payload. The tiny transformer's parameters have even
first dimensions whose halves are whole chunks (chunk 16), so both runs compress the same
coefficients; what may differ is float rounding (FSDP2's gathered weights and reduce-scattered
gradients sum in another order), which can flip the sign of a near-zero coefficient: a tie.

A hybrid run saves through torch.distributed.checkpoint; stopped after step N and resumed, it takes
the uninterrupted run's steps bit for bit, and its checkpoints resume on no other layout.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from distro_opt.comm import CommStats
from distro_opt.experiments.model import parameter_shapes
from distro_opt.experiments import run
from distro_opt.experiments.presets import get_preset
from distro_opt.experiments.process_group import one_machine_env
from distro_opt.experiments.sharded_checkpoint import checksum
from distro_opt.wire import PayloadLayout, param_spec

from _models import TINY_TRANSFORMER_FLAGS
from _procs import wait_all
from _ranks import expect_success, launch as launch_scenarios

STEPS = 4
TOPK, CHUNK = 4, 16
ARMS = f"adamw,distro:chunk={CHUNK},topk={TOPK}"
HEADER_BYTES = 8  # the frame header of TorchDistributedBackend's all-gather (test_torch_backend.py)
# Train losses of the sharded and the unsharded run agree to this (relative): a sum reordered by the
# sharding rounds differently in float32 (~1e-7 of a loss), and a sign tie would move one coefficient's
# +-lr update, which changes a few-step run's loss by less than this. (Here they come out equal.)
LOSS_RTOL = 1e-5


def run_args(corpus, out, workers, shard_degree, arms=ARMS, steps=STEPS, extra=()):
    folder, cache = corpus
    return ["--preset", "smoke", "--arms", arms, "--workers", workers, "--shard-degree", shard_degree,
            "--out", out, "--cache", cache, "--corpus", folder, "--tokenizer", "byte",
            *TINY_TRANSFORMER_FLAGS, "--seq-len", "32", "--batch-size", "2", "--steps", steps,
            "--warmup-steps", "1", "--eval-every", "1000", "--eval-batches", "1",
            "--eval-batch-size", "2", "--checkpoint-every", "1", "--no-progress", "--no-plots",
            "--timeout-s", "30", *extra]


def launch(tmp_path, args, world_size, timeout_s=90, module="run"):
    """``experiments.{module}`` on ``world_size`` ranks; [(exit code, stdout, stderr)] of each."""
    rendezvous = tmp_path / f"rendezvous-{world_size}-{time.monotonic_ns()}"
    procs = [subprocess.Popen([sys.executable, "-m", f"distro_opt.experiments.{module}", *map(str, args)],
                              cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                 **one_machine_env(rank, world_size, rendezvous)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world_size)]
    return wait_all(procs, timeout_s, stdout=True)


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
    # the hybrid run with activation checkpointing: recomputing a sharded block's forward gives the
    # same numbers
    hybrid = ["--activation-checkpointing", "true"]
    for out, world, shard, extra in ((outs[0], 4, 2, hybrid), (outs[1], 2, 1, ())):
        for code, _, err in launch(tmp, run_args(corpus, out, 2, shard, extra=extra), world):
            assert code == 0, err
    return outs


def test_hybrid_losses_equal_the_unsharded_runs(runs):
    hybrid, plain = map(train_losses, runs)
    assert sorted(hybrid) == sorted(plain) and len(hybrid) == 2
    for arm in plain:
        assert len(hybrid[arm]) == STEPS
        assert hybrid[arm] == pytest.approx(plain[arm], rel=LOSS_RTOL), arm


def _rank_file(out, arm_slug, rank, step=2):
    """``rank``'s file of a step's checkpoint: progress counters and its layout, with a checksum of
    the shards it saved into the DCP folder beside it."""
    return torch.load(out / "checkpoints" / f"{arm_slug}-seed0" / f"step{step}.rank{rank}.pt",
                      map_location="cpu", weights_only=False)


def test_ranks_holding_the_same_shard_hold_bitwise_identical_replicas(runs):
    hybrid, _ = runs
    folders = sorted(p.name.removesuffix("-seed0") for p in (hybrid / "checkpoints").iterdir())
    assert len(folders) == 2
    for slug in folders:
        ranks = [_rank_file(hybrid, slug, r)["sharded"] for r in range(4)]
        assert {(r["world_size"], r["shard_degree"]) for r in ranks} == {(4, 2)}
        # ranks 0, 2 hold shard 0 (replicas 0, 1); ranks 1, 3 shard 1
        assert ranks[0]["params"] == ranks[2]["params"] != ranks[1]["params"] == ranks[3]["params"], slug


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


def test_a_hybrid_runs_ratios_are_per_replica_with_one_ranks_beside_them(runs):
    hybrid, plain = runs
    summary, unsharded = (json.loads((out / "summary.json").read_text()) for out in runs)
    distro = _result(hybrid, "distro")
    config = json.loads((hybrid / "config.json").read_text())
    shapes = parameter_shapes(type(get_preset("smoke"))(**config["preset"]).model_config(config["vocab_size"]))
    shard = PayloadLayout([param_spec((s[0] // 2, *s[1:]), TOPK, CHUNK, 1) for _, s in shapes]).nbytes
    n = sum(torch.Size(s).numel() for _, s in shapes)
    arm = summary["arms"][distro["arm"]]
    # replica 0 is ranks 0 and 1, one half of every tensor each: the whole model costs both payloads
    assert (arm["shard_degree"], distro["replica_payload_nbytes"]) == (2, 2 * shard)
    assert arm["compression_vs_dense_bf16"] == pytest.approx(2 * n / (2 * shard))
    assert arm["compression_vs_dense_bf16_per_rank"] == pytest.approx(2 * n / shard)
    rows = [json.loads(line) for line in (hybrid / "metrics.jsonl").read_text().splitlines()]
    rank0 = max((r for r in rows if r["arm"] == distro["arm"]), key=lambda r: r["step"])  # its sink's
    assert arm["sent_bytes_per_step"] == 2 * rank0["cum_sent_bytes"] / STEPS  # two equal halves
    # the same coefficients as the unsharded run (not twice as few), which sends them in one payload
    # where a replica sends two, each with its own fixed bytes (a few percent of this tiny model's)
    assert arm["compression_vs_dense_bf16"] == pytest.approx(
        unsharded["arms"][distro["arm"]]["compression_vs_dense_bf16"], rel=0.05)
    # AdamW: every rank all-reduces its shard's fp32 gradient, a replica the whole model's, as unsharded
    assert summary["arms"]["adamw"]["compression_vs_dense_bf16"] == pytest.approx(0.5)
    assert unsharded["arms"]["adamw"]["compression_vs_dense_bf16"] == pytest.approx(0.5)
    table = (hybrid / "summary.md").read_text()
    assert f"{arm['compression_vs_dense_bf16']:,.1f}x ({arm['compression_vs_dense_bf16_per_rank']:,.1f}x per rank)" in table
    assert "shard degree 2: a worker is one replica of 2 ranks" in table
    assert "per rank" not in (plain / "summary.md").read_text()


def test_llama_preset_shards_each_replica_over_one_node_of_8():
    preset = get_preset("llama-1.2b")
    assert (preset.shard_degree, preset.activation_checkpointing, preset.autocast) == (8, True, "bf16")


def one_line_error_on_every_rank(results, text):
    for code, _, err in results:
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
        assert text in err, err


def test_a_shard_degree_that_does_not_divide_the_world_is_one_line(corpus, tmp_path):
    out = tmp_path / "run"  # one rank: the check is the same on every rank of a larger world
    results = launch(tmp_path, run_args(corpus, out, 1, 2), 1, timeout_s=60)
    one_line_error_on_every_rank(results, "Invalid shard_degree: 2 does not divide the world size 1")
    assert not out.exists()


def _stopped_after_step_2(runs, tmp_path):
    """A copy of the hybrid run's --out as a run stopped after step 2 leaves it: the newest complete
    checkpoint is step 2's, no arm has its result, the metrics run on past the checkpoint."""
    out = tmp_path / "stopped"
    shutil.copytree(runs[0], out)
    for folder in (out / "checkpoints").iterdir():
        for later in folder.glob("step3.*"):
            shutil.rmtree(later) if later.is_dir() else later.unlink()
    for result in (out / "results").iterdir():
        result.unlink()
    return out


def _dcp_contents(folder, tmp_path):
    """Every tensor and value a DCP folder holds (the model's and the optimizer's), read on one
    process as whole tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, target)
    return torch.load(target, weights_only=False)


def _assert_same(a, b, where=""):
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def _rows(out):
    """{(arm, step): metrics row}."""
    return {(r["arm"], r["step"]): r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_a_stopped_hybrid_run_resumes_bit_identically(runs, corpus, tmp_path):
    out = _stopped_after_step_2(runs, tmp_path)
    args = run_args(corpus, out, 2, 2, extra=["--activation-checkpointing", "true", "--resume"])
    for code, _, err in launch(tmp_path, args, 4):
        assert code == 0, err
    want, got = _rows(runs[0]), _rows(out)
    assert sorted(got) == sorted(want) and len(got) == 2 * (STEPS + 1)
    for key, row in got.items():
        assert [row[k] for k in ("train_loss", "val_loss", "lr", "tokens")] == \
            [want[key][k] for k in ("train_loss", "val_loss", "lr", "tokens")], key
        # The counters go on from the checkpoint. A new process's backend first agrees on what its
        # collectives carry, as the uninterrupted run did at step 1 (AdamW: the all-reduce's
        # descriptor; DisTrOAdamW: the payload's size, announced again after the replica check
        # that follows a load): the first step after the resume sends that once more.
        arm, step = key
        start_up = want[(arm, 1)]["sent_bytes"] - want[(arm, 2)]["sent_bytes"] if step > 2 else 0
        assert row["cum_sent_bytes"] == want[key]["cum_sent_bytes"] + start_up, key
        assert row["collectives"] == want[key]["collectives"], key
    for slug in sorted(p.name.removesuffix("-seed0") for p in (out / "checkpoints").iterdir()):
        # step 3's checkpoint, saved again by the resumed run: model and optimizer state, bit for bit
        folder = f"checkpoints/{slug}-seed0/step3.dcp"
        _assert_same(_dcp_contents(runs[0] / folder, tmp_path), _dcp_contents(out / folder, tmp_path), slug)
        for rank in range(4):
            files = [_rank_file(o, slug, rank, step=3) for o in (runs[0], out)]
            assert files[0]["sharded"] == files[1]["sharded"], (slug, rank)


def test_a_hybrid_runs_checkpoints_are_refused_on_another_layout_naming_both(runs, corpus, tmp_path):
    out = _stopped_after_step_2(runs, tmp_path)
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*"))
    args = run_args(corpus, out, 1, 1, extra=["--activation-checkpointing", "true", "--resume"])
    one_line_error_on_every_rank(launch(tmp_path, args, 1, timeout_s=60),
                                 "(differs in: shard_degree, workers; it was saved by 4 ranks at shard degree 2, "
                                 "this run has 1 rank at shard degree 1)")
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_a_hybrid_set_that_cannot_resume_is_refused_naming_it(runs, corpus, tmp_path):
    """What --resume checks on rank 0 before any rank trains (a hybrid set loads on every rank at once)."""
    from distro_opt.experiments.checkpoint import CheckpointError, CheckpointStore

    out = _stopped_after_step_2(runs, tmp_path)
    preset = get_preset("smoke")
    config = json.loads((out / "config.json").read_text())
    shapes = parameter_shapes(type(preset)(**config["preset"]).model_config(config["vocab_size"]))
    slug = sorted(p.name for p in (out / "checkpoints").iterdir())[1].removesuffix("-seed0")
    store = CheckpointStore(out, slug, 0, 4)
    store.check_sharded(2, shapes)  # as saved: resumable
    with pytest.raises(CheckpointError, match="holds embed.weight of shape"):
        store.check_sharded(2, [("embed.weight", (1, 2)), *shapes])
    rank2 = store.dir / "step2.rank2.pt"  # rank 2 holds shard 0, as rank 0 does
    saved = torch.load(rank2, weights_only=False)
    saved["sharded"]["params"] = "0" * 16
    torch.save(saved, rank2)
    with pytest.raises(CheckpointError, match=f"checkpoint {rank2} holds other parameters than rank 0, .*"
                                              "start this arm over"):
        store.check_sharded(2, shapes)
    saved["sharded"]["params"] = torch.load(store.dir / "step2.rank0.pt", weights_only=False)["sharded"]["params"]
    torch.save(saved, rank2)
    data = store.dir / "step2.dcp" / "__1_0.distcp"  # rank 1's shards, which the index points into
    whole = data.read_bytes()
    data.write_bytes(whole[:100])
    with pytest.raises(CheckpointError, match=f"step2.dcp holds __1_0.distcp cut short \\(100 of the {len(whole):,} "
                                              "bytes its .metadata names\\)"):
        store.check_sharded(2, shapes)
    data.unlink()
    with pytest.raises(CheckpointError, match="step2.dcp lacks __1_0.distcp, a data file its .metadata names"):
        store.check_sharded(2, shapes)
    data.write_bytes(whole)
    store.check_sharded(2, shapes)
    (store.dir / "step2.dcp" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"step2.dcp holds no readable .metadata \(FileNotFoundError\)"):
        store.check_sharded(2, shapes)


def test_a_hybrid_set_that_fails_inside_the_collective_load_is_one_line_on_every_rank(runs, corpus, tmp_path):
    """Damage that keeps the files' sizes passes the start-up check; the load, a collective of every
    rank, then fails on every rank alike: one line each, exit code 2, the checkpoints untouched."""
    out = _stopped_after_step_2(runs, tmp_path)
    arm_dir = sorted((out / "checkpoints").iterdir())[0]  # the first arm to resume
    data = arm_dir / "step2.dcp" / "__1_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in (out / "checkpoints").rglob("*"))
    args = run_args(corpus, out, 2, 2, extra=["--activation-checkpointing", "true", "--resume"])
    results = launch(tmp_path, args, 4)
    one_line_error_on_every_rank(results, "does not fit this model and optimizer (ValueError: checkpoint")
    for _, _, err in results:
        assert "step2.dcp could not be loaded" in err, err
        assert f"move the step2.rank*.pt files out of {arm_dir} to start this arm over" in err, err
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in (out / "checkpoints").rglob("*")) == before


def test_an_in_process_run_with_a_shard_degree_is_one_line(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run.main(list(map(str, run_args(corpus, tmp_path / "run", 2, 2)))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: shard_degree 2 needs torchrun") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


# -- experiments.train_ddp ------------------------------------------------------------------------

# chunk 4: every local shard of the MLP (first dimensions 32 and 4) is whole chunks, as unsharded
DDP_ARGS = ["--no-log", "--timeout-s", "30", "--steps", "4", "--compression-chunk", "4",
            "--compression-topk", "2"]


def _closing_lines(results):
    """Each rank's last line: rank R: eval loss L | params C | payload P B/step | ..."""
    lines = []
    for code, stdout, err in results:
        assert code == 0, err
        closing = stdout.strip().splitlines()[-1].split(": ", 1)[1]
        fields = dict(f.strip().split(" ", 1) for f in closing.split("|"))
        lines.append(fields)
    return lines


@pytest.fixture(scope="module")
def ddp_hybrid(tmp_path_factory):
    """train_ddp on a 2 x 2 mesh, in one process group: 4 steps uninterrupted, then 2 steps saved to
    a --save-dir and 2 more resumed from it. Returns ({job: each rank's result}, the --save-dir)."""
    tmp = tmp_path_factory.mktemp("ddp_hybrid")
    hybrid, saved = [*DDP_ARGS, "--shard-degree", "2"], str(tmp / "saved")
    jobs = [["whole", "train", hybrid], ["saved", "train", [*hybrid, "--steps", "2", "--save-dir", saved]],
            ["resumed", "train", [*hybrid, "--steps", "2", "--resume-dir", saved]]]
    results, codes = launch_scenarios(jobs, 4, tmp, timeout_s=120)
    expect_success(results, codes, tmp)
    return {name: [r[name] for r in results] for name, _, _ in jobs}, tmp / "saved"


def test_train_ddp_hybrid_takes_the_unsharded_runs_steps_on_local_shards(tmp_path, ddp_hybrid):
    hybrid = ddp_hybrid[0]["whole"]
    plain = _closing_lines(launch(tmp_path, DDP_ARGS, 2, 60, "train_ddp"))
    assert len({(checksum(r["params"]), r["eval_loss"]) for r in hybrid}) == 1  # every rank: the same full model
    assert hybrid[0]["eval_loss"] == pytest.approx(float(plain[0]["eval"].split()[1]), rel=LOSS_RTOL)
    shapes = [(32, 16), (32,), (32, 64), (32,), (4, 64), (4,)]  # TinyMLP's shards over 2 ranks
    layout = PayloadLayout([param_spec(s, 2, 4, 1) for s in shapes])
    assert hybrid[0]["payload_nbytes"] == layout.nbytes
    assert int(plain[0]["payload"].split()[0]) > layout.nbytes


def test_train_ddp_hybrid_saves_through_dcp_and_resumes_bit_identically(ddp_hybrid):
    runs, saved = ddp_hybrid
    assert sorted(p.name for p in saved.glob("rank*.pt")) == [f"rank{r}.pt" for r in range(4)]
    (folder,) = saved.glob("sharded-*")  # DCP's: one data file per rank, its index written last
    assert sorted(p.name for p in saved.iterdir()) == [f"rank{r}.pt" for r in range(4)] + [folder.name]  # no lock
    assert (folder / ".metadata").is_file() and len(list(folder.glob("*.distcp"))) == 4
    for whole, first, resumed in zip(runs["whole"], runs["saved"], runs["resumed"]):
        assert first["losses"] + resumed["losses"] == whole["losses"]
        assert resumed["eval_loss"] == whole["eval_loss"]
        assert all(torch.equal(resumed["params"][k], whole["params"][k]) for k in whole["params"])


def test_train_ddp_shard_degree_that_does_not_divide_the_world_is_one_line(tmp_path):
    results = launch(tmp_path, [*DDP_ARGS, "--shard-degree", "2"], 1, 60, "train_ddp")
    one_line_error_on_every_rank(results, "Invalid shard_degree: 2 does not divide the world size 1")


def test_train_ddp_refuses_a_sharded_checkpoint_on_another_layout_naming_both(tmp_path, ddp_hybrid):
    _, saved = ddp_hybrid
    before = sorted((p.name, p.stat().st_mtime_ns) for p in saved.rglob("*"))
    results = launch(tmp_path, [*DDP_ARGS, "--resume-dir", saved], 1, 60, "train_ddp")
    one_line_error_on_every_rank(results, f"--resume-dir {saved} was saved by 4 ranks at shard degree 2, "
                                          "this run has 1 rank at shard degree 1")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in saved.rglob("*")) == before


def test_train_ddp_refuses_a_sharded_checkpoint_with_a_data_file_cut_short_before_training(tmp_path, ddp_hybrid):
    saved = tmp_path / "saved"
    shutil.copytree(ddp_hybrid[1], saved)
    (folder,) = saved.glob("sharded-*")
    data = folder / "__2_0.distcp"
    whole = data.stat().st_size
    data.write_bytes(data.read_bytes()[:10])
    results = launch(tmp_path, [*DDP_ARGS, "--shard-degree", "2", "--resume-dir", saved], 4, 60, "train_ddp")
    one_line_error_on_every_rank(results, f"Checkpoint {str(saved)!r} cannot be resumed: {folder.name} holds "
                                          f"__2_0.distcp cut short (10 of the {whole:,} bytes its .metadata names)")
