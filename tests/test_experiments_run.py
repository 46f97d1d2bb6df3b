"""The runner on a tiny model: bad input, determinism, bytes against the formula, interrupt and resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from distro_opt import DisTrOAdamW
from distro_opt.comm import CommStats, SingleWorkerBackend
from distro_opt.experiments import data, run
from distro_opt.experiments.metrics import read_metrics
from distro_opt.experiments.model import build_model
from distro_opt.experiments.process_group import one_machine_env
from distro_opt.experiments.presets import get_preset

COMPARED = (
    "train_loss",
    "val_loss",
    "lr",
    "tokens",
    "sent_bytes",
    "received_bytes",
    "cum_sent_bytes",
    "cum_received_bytes",
    "collectives",
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small byte-level corpus in its own cache: offline and fast."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["thou", "art", "king", "lear", "to", "be", "or", "not", "love", "night", "the", "and"]
    folder = root / "texts"
    folder.mkdir()
    (folder / "play.txt").write_text(" ".join(words[i] for i in rng.integers(0, len(words), size=20_000)))
    data.prepare(str(folder), "byte", cache=root / "cache")
    return folder, root / "cache"


def tiny_args(corpus, out, steps=12, extra=()):
    folder, cache = corpus
    return [
        "--preset",
        "smoke",
        "--arms",
        "adamw,distro",
        "--workers",
        "2",
        "--out",
        str(out),
        "--cache",
        str(cache),
        "--corpus",
        str(folder),
        "--tokenizer",
        "byte",
        "--n-layers",
        "1",
        "--d-model",
        "32",
        "--n-heads",
        "2",
        "--d-ff",
        "64",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--steps",
        str(steps),
        "--warmup-steps",
        "2",
        "--eval-every",
        "4",
        "--eval-batches",
        "2",
        "--eval-batch-size",
        "4",
        "--checkpoint-every",
        "4",
        "--no-progress",
        "--no-plots",
        "--timeout-s",
        "60",
        *extra,
    ]


def comparable(rows):
    return {(r["arm"], r["seed"], r["step"]): tuple(r[k] for k in COMPARED) for r in rows}


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "straight"
    assert run.main(tiny_args(corpus, out, steps=40)) == 0
    return out


def test_unknown_preset_is_a_one_line_error_with_exit_2(corpus, tmp_path, capsys):
    args = tiny_args(corpus, tmp_path / "x")
    args[args.index("smoke")] = "huge"
    assert run.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: Unknown preset 'huge' (expected one of smoke, parity, llama-1.2b)"
    assert not (tmp_path / "x").exists()


def test_unknown_arm_option_is_an_error_with_exit_2(corpus, tmp_path, capsys):
    assert run.main(tiny_args(corpus, tmp_path / "x", extra=("--arms", "distro:bitz=2"))) == 2
    assert "Unknown option 'bitz'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_wrongly_typed_flag_exits_2_naming_the_flag(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run.main(tiny_args(corpus, tmp_path / "x", extra=("--steps", "many")))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps" in err[0] and "'many'" in err[0]


def test_missing_token_cache_names_the_prepare_command(corpus, tmp_path, capsys):
    args = tiny_args(corpus, tmp_path / "x")
    args[args.index("--cache") + 1] = str(tmp_path / "empty-cache")
    assert run.main(args) == 2
    assert "python -m experiments.prepare --corpus" in capsys.readouterr().err


def test_output_dir_holding_a_different_run_is_refused_and_left_alone(corpus, straight, capsys):
    before = {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()}
    assert run.main(tiny_args(corpus, straight, steps=41, extra=("--resume",))) == 2
    assert "holds a different run (differs in: steps)" in capsys.readouterr().err
    assert run.main(tiny_args(corpus, straight, steps=40)) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()} == before


def test_run_saved_before_a_preset_field_existed_still_resumes(corpus, straight, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(straight, old)
    config = json.loads((old / "config.json").read_text())
    del config["preset"]["sharding"]  # added later; such runs drew contiguous shards, the default
    (old / "config.json").write_text(json.dumps(config))
    assert run.main(tiny_args(corpus, old, steps=40, extra=("--resume",))) == 0
    assert run.main(tiny_args(corpus, old, steps=40, extra=("--resume", "--sharding", "iid"))) == 2


def test_same_seed_gives_the_same_metrics(corpus, straight, tmp_path):
    assert run.main(tiny_args(corpus, tmp_path / "again", steps=40)) == 0
    assert comparable(read_metrics(tmp_path / "again" / "metrics.jsonl")) == comparable(
        read_metrics(straight / "metrics.jsonl")
    )


def test_both_arms_learn_on_the_tiny_corpus(straight):
    summary = json.loads((straight / "summary.json").read_text())
    for arm in ("adamw", "distro"):
        assert summary["arms"][arm]["final_val_loss_mean"] < summary["arms"][arm]["initial_val_loss"] - 0.5


def test_reported_bytes_equal_backend_counters_and_codec_formula(corpus, straight):
    summary = json.loads((straight / "summary.json").read_text())
    results = {p.stem: json.loads(p.read_text()) for p in (straight / "results").glob("*.json")}
    preset = get_preset("smoke")
    cfg = type(preset.model_config())(
        vocab_size=256, n_layers=1, d_model=32, n_heads=2, d_ff=64, max_seq_len=32
    )
    opt = DisTrOAdamW(build_model(cfg, seed=0).parameters(), comm=SingleWorkerBackend())
    n_params = sum(p.numel() for p in build_model(cfg, seed=0).parameters())
    expected = {
        "distro": CommStats.all_gather_bytes(opt.payload_nbytes, 2),
        "adamw": CommStats.ring_all_reduce_bytes(4 * n_params, 2),
    }
    for arm, per_step in expected.items():
        assert summary["arms"][arm]["sent_bytes_per_step"] == per_step
        assert summary["arms"][arm]["received_bytes_per_step"] == per_step
        assert [w["sent"] for w in results[f"{arm}-seed0"]["workers"]] == [40 * per_step] * 2
        assert summary["arms"][arm]["bytes_match_formula"] is True
    assert summary["arms"]["distro"]["compression_vs_dense_bf16"] == pytest.approx(
        2 * n_params / opt.payload_nbytes
    )


def test_worker_replicas_stay_identical(straight):
    for arm in ("adamw", "distro"):
        ckpt = straight / "checkpoints" / f"{arm}-seed0"
        states = [torch.load(ckpt / f"step36.rank{r}.pt", weights_only=False)["model"] for r in (0, 1)]
        assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def _run_and_interrupt(args, out, sig, after_rows):
    cmd = [sys.executable, "-m", "distro_opt.experiments.run", *args]
    proc = subprocess.Popen(cmd, cwd=out.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(read_metrics(out / "metrics.jsonl")) >= after_rows:
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err.decode()


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)])
def test_interrupted_run_resumes_to_the_same_numbers(corpus, straight, tmp_path, sig, code):
    out = tmp_path / "interrupted"
    args = tiny_args(corpus, out, steps=40)
    rc, err = _run_and_interrupt(args, out, sig, after_rows=20)
    assert rc == code, err
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r["step"] for r in rows if r["arm"] == "adamw"]
    assert steps == list(range(len(steps))) and len(rows) < 82  # valid so far, and really cut short
    _resume(args, tmp_path)
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(
        read_metrics(straight / "metrics.jsonl")
    )


def _resume(args, cwd):
    done = subprocess.run(
        [sys.executable, "-m", "distro_opt.experiments.run", *args, "--resume"],
        cwd=cwd,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()


def test_interrupted_overlap_run_resumes_to_the_same_numbers(corpus, tmp_path):
    extra = ("--arms", "distro:overlap=true")
    assert run.main(tiny_args(corpus, tmp_path / "straight", steps=40, extra=extra)) == 0
    out = tmp_path / "interrupted"
    args = tiny_args(corpus, out, steps=40, extra=extra)
    rc, err = _run_and_interrupt(args, out, signal.SIGINT, after_rows=15)
    assert rc == 130, err
    _resume(args, tmp_path)
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(
        read_metrics(tmp_path / "straight" / "metrics.jsonl")
    )


def test_demo_and_option_arms_report_their_own_payload(corpus, tmp_path):
    out = tmp_path / "arms"
    assert run.main(tiny_args(corpus, out, steps=4, extra=("--arms", "demo,distro:topk=8,bits=2"))) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reference"] is None
    demo, distro = summary["arms"]["demo"], summary["arms"]["distro:topk=8,bits=2"]
    assert demo["sent_bytes_per_step"] == CommStats.all_gather_bytes(demo["payload_nbytes"], 2)
    assert distro["payload_nbytes"] < demo["payload_nbytes"]  # 2-bit values vs DeMo's float32
    assert demo["bytes_match_formula"] and distro["bytes_match_formula"]


def test_resume_without_a_run_is_an_error(corpus, tmp_path, capsys):
    assert run.main(tiny_args(corpus, tmp_path / "none", extra=("--resume",))) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_torch_distributed_ranks_train_like_in_process_workers(corpus, straight, tmp_path):
    out = tmp_path / "dist"
    procs = []
    for rank in range(2):
        env = {**os.environ, **one_machine_env(rank, 2, tmp_path / "rendezvous")}  # no TCP store
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "distro_opt.experiments.run", *tiny_args(corpus, out, steps=40)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()
    losses = {k: v[:2] for k, v in comparable(read_metrics(out / "metrics.jsonl")).items()}
    assert losses == {k: v[:2] for k, v in comparable(read_metrics(straight / "metrics.jsonl")).items()}
    dist_summary = json.loads((out / "summary.json").read_text())
    local_summary = json.loads((straight / "summary.json").read_text())
    assert (
        dist_summary["arms"]["adamw"]["sent_bytes_per_step"]
        == local_summary["arms"]["adamw"]["sent_bytes_per_step"]
    )
    # The torch backend frames each payload (a length prefix it counts as sent): never less than the formula.
    assert dist_summary["arms"]["distro"]["per_seed"]["0"]["sent_minus_formula_bytes_per_step"] >= 0
