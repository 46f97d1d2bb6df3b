"""The peer arms of experiments.run: demo-peer (pytorch_optimizer.DeMo) and powersgd (torch's DDP
PowerSGD hook) train under torch.distributed as 2 Gloo ranks (real processes, 127.0.0.1, the
rendezvous in a file, every wait bounded), their bytes in the runner's ledger are the formula (and
DeMo's own counters), diloco trains in-process as DisTrOAdamW's local-step mode, and the arm
strings and an in-process start of a peer arm are refused with one line."""
from __future__ import annotations

import json

import pytest
import torch

from distro_opt.comm import CommStats
from distro_opt.updates import OuterUpdate
from distro_opt.experiments import run
from distro_opt.experiments.arms import build_optimizer, parse_arms
from distro_opt.experiments.model import build_model
from distro_opt.experiments.peer_arms import demo_payload_nbytes, powersgd_elements
from distro_opt.experiments.presets import get_preset

from _procs import wait_all
from _ranks import run_args, start_ranks

STEPS = 8


def _run_ranks(corpus, tmp_path, arms):
    out = tmp_path / "run"
    procs = start_ranks(tmp_path, [run_args(corpus, out, steps=STEPS, arms=arms)] * 2, tmp_path / "rendezvous")
    for code, err in wait_all(procs, 120):
        assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    result = json.loads((out / "results" / f"{parse_arms(arms)[0].slug}-seed0.json").read_text())
    return summary["arms"][arms], result


def _model_shapes(result):
    # the runner's tiny model for the byte tokenizer (vocab 256), built here as each rank builds it
    preset = run.apply_overrides(get_preset("smoke"), run.build_parser().parse_args(
        ["--out", "x", "--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--d-ff", "64", "--seq-len", "32"]))
    model = build_model(preset.model_config(256), seed=0)
    assert sum(p.numel() for p in model.parameters()) == result["n_params"]
    return [p for p in model.parameters() if p.requires_grad]


def _check_trained(arm_summary, workers_sent):
    job = arm_summary["per_seed"]["0"]
    assert torch.isfinite(torch.tensor(job["final_val_loss"]))
    assert job["final_val_loss"] < job["initial_val_loss"] - 0.05
    assert arm_summary["bytes_match_formula"] and job["bytes_match_formula"]
    assert len(set(workers_sent)) == 1  # both ranks sent the same


def test_demo_peer_trains_and_its_bytes_are_its_all_gathers_and_its_own_counters(corpus, tmp_path):
    arm, result = _run_ranks(corpus, tmp_path, "demo-peer:topk=8,lr=0.003")
    payload = demo_payload_nbytes(_model_shapes(result), topk=8, chunk=64)
    assert result["payload_nbytes"] == payload  # every step the runner held this to DeMo's data_transmit
    worker = result["workers"][0]
    assert worker["sent"] == worker["received"] == STEPS * CommStats.all_gather_bytes(payload, 2)
    assert worker["collectives"] == STEPS
    _check_trained(arm, [w["sent"] for w in result["workers"]])


def test_powersgd_trains_and_its_bytes_are_dense_then_p_q_and_uncompressed(corpus, tmp_path):
    # small DDP buckets: several per step, whose chained all-reduces Gloo must see in one order
    arm, result = _run_ranks(corpus, tmp_path, "powersgd:rank=2,start_iter=3,lr=0.003,bucket_cap_mb=0.02")
    params = _model_shapes(result)
    plain, p_total, q_total = powersgd_elements([p.shape for p in params], 2, 2.0)
    assert p_total > 0 and q_total > 0 and plain > 0  # both kinds of tensor occur in the model
    dense = 4 * sum(p.numel() for p in params)  # with 2 ranks a ring all-reduce sends S bytes
    want = 3 * dense + (STEPS - 3) * 4 * (plain + p_total + q_total)
    assert result["workers"][0]["sent"] == result["workers"][0]["received"] == want
    assert want < STEPS * dense
    assert result["payload_nbytes"] == round(want / STEPS)  # with 2 ranks a ring sends what it reduces
    dense_bf16 = 2 * sum(p.numel() for p in params)
    assert arm["per_seed"]["0"]["compression_vs_dense_bf16"] == pytest.approx(dense_bf16 / round(want / STEPS))
    _check_trained(arm, [w["sent"] for w in result["workers"]])


def test_diloco_trains_in_process_sending_the_whole_pseudo_gradient_every_h_steps(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    args = [str(a) for a in run_args(corpus, out, steps=STEPS, arms="diloco:H=4")]
    assert run.main(args) == 0
    summary = json.loads((out / "summary.json").read_text())["arms"]["diloco:H=4"]
    result = json.loads((out / "results" / "diloco_H_4-seed0.json").read_text())
    worker = result["workers"][0]
    assert worker["collectives"] == STEPS // 4  # one per sync (the replica check is counted apart)
    assert worker["sent"] == STEPS // 4 * CommStats.all_gather_bytes(result["payload_nbytes"], 2)
    # every coefficient, as bf16, with its index: more than a dense bf16 pseudo-gradient, and said so
    assert result["payload_nbytes"] > 2 * result["n_params"]
    _check_trained(summary, [w["sent"] for w in result["workers"]])


def test_the_diloco_arm_is_distro_local_steps_with_nesterov_outer_sgd_and_every_coefficient():
    arm, = parse_arms("diloco:H=12")
    opt = build_optimizer(arm, [("w", torch.nn.Parameter(torch.zeros(64, 64)))], get_preset("smoke"), None)
    group = opt.param_groups[0]
    assert opt.sync_every == 12 and group["outer_lr"] == 0.7 and group["outer_momentum"] == 0.9
    assert group["compression_topk"] == 64 * 64 and group["compression_bits"] == 16
    assert group["compression_decay"] == 0.0
    assert isinstance(opt.inner_optimizer, torch.optim.AdamW)


def test_the_outer_update_is_torchs_nesterov_sgd_on_the_pseudo_gradient():
    g = torch.Generator().manual_seed(0)
    anchor = torch.randn(8, 8, generator=g)
    state, group = {"anchor": anchor.clone()}, {"outer_lr": 0.7, "outer_momentum": 0.9}
    reference = torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(3):  # the second sync on is where momentum (and Nesterov's look-ahead) shows
        pseudo_gradient = torch.randn(8, 8, generator=g)
        OuterUpdate()(group, torch.zeros(8, 8), pseudo_gradient.clone(), state)
        reference.grad = pseudo_gradient.clone()
        sgd.step()
        torch.testing.assert_close(state["anchor"], reference.detach())


@pytest.mark.parametrize("arms", ["demo-peer", "adamw,powersgd:rank=2"])
def test_an_in_process_run_of_a_peer_arm_is_one_line_naming_torchrun(corpus, tmp_path, capsys, arms):
    assert run.main([str(a) for a in run_args(corpus, tmp_path / "run", arms=arms)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs torch.distributed" in err, err
    assert f"torchrun --standalone --nproc-per-node 2 -m experiments.run --arms {arms} " in err, err
    assert not (tmp_path / "run").exists()


def test_a_peer_arm_does_not_resume(corpus, tmp_path, capsys):
    args = [str(a) for a in run_args(corpus, tmp_path / "run", arms="adamw,demo-peer")]
    assert run.main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err == "error: arm 'demo-peer' cannot --resume: its communication state is not checkpointed; run it again\n"


def test_a_peer_arm_does_not_run_sharded(corpus, tmp_path, capsys):
    args = [str(a) for a in run_args(corpus, tmp_path / "run", arms="powersgd")]
    assert run.main([*args, "--shard-degree", "2"]) == 2
    assert capsys.readouterr().err == "error: arm 'powersgd' does not run sharded: pass --shard-degree 1 for it\n"


@pytest.mark.parametrize("arms, message", [
    ("powersgd:rank=x", "Invalid value 'x' for option 'matrix_approximation_rank'"),
    ("powersgd:rank=0", "Invalid matrix_approximation_rank value: 0"),
    ("powersgd:topk=4", "Unknown option 'topk' for arm 'powersgd'"),
    ("demo-peer:bits=2", "Unknown option 'bits' for arm 'demo-peer'"),
    ("demo-peer:decay=1.0", "Invalid compression_decay value: 1.0"),
    ("diloco:topk=8", "Unknown option 'topk' for arm 'diloco'"),
    ("diloco:H=0", "Invalid sync_every value: 0"),
])
def test_bad_peer_arm_strings_are_refused_before_training(corpus, tmp_path, capsys, arms, message):
    assert run.main([str(a) for a in run_args(corpus, tmp_path / "run", arms=arms)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
