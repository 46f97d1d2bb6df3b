"""The runner on a tiny model: bad input, determinism, bytes against the formula, interrupt and resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from distro_opt import DisTrOAdamW
from distro_opt.guards import CHECKSUM_NBYTES
from distro_opt.comm import CommStats, SingleWorkerBackend
from distro_opt.comm.torch_backend import DESCRIPTOR_BYTES
from distro_opt.experiments import run
from distro_opt.experiments.arms import parse_arms
from distro_opt.experiments.metrics import read_metrics
from distro_opt.experiments.model import build_model
from distro_opt.experiments.process_group import one_machine_env
from distro_opt.experiments.presets import get_preset

from _models import tiny_args
from _procs import default_sigint, wait_all

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
    assert err == "error: Unknown preset 'huge' (expected one of smoke, parity, volunteer, llama-1.2b)"
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


def test_help_gives_each_presets_value_rather_than_the_smokes_as_every_default(capsys):
    with pytest.raises(SystemExit):
        run.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(smoke: 300, parity: 3000, volunteer: 300, llama-1.2b: 25000)" in text  # --steps
    assert "(smoke: '0', parity: '0,1', volunteer: '0', llama-1.2b: '0')" in text  # --seeds
    assert "preset default" not in text


@pytest.mark.parametrize("flags, message", [
    (("--seeds", "-1"), "Invalid seeds: '-1'"),
    (("--seeds", str(2**64)), "Invalid seeds"),
    (("--timeout-s", "0"), "Invalid timeout_s: 0.0"),
    (("--timeout-s", "nan"), "Invalid timeout_s: nan"),
    (("--timeout-s", "inf"), "Invalid timeout_s: inf"),
    (("--timeout-s", "1e12"), "Invalid timeout_s: 1000000000000.0"),
    (("--device", "foo"), "Invalid device 'foo'"),
    (("--device", "meta"), "Invalid device 'meta'"),
    (("--torch-threads", "-1"), "Invalid torch_threads: -1"),
    (("--grad-clip", "-1"), "Invalid grad_clip: -1.0"),
    (("--grad-clip", "nan"), "Invalid grad_clip: nan"),
    (("--seq-len", "10000"), "Validation split of"),
    (("--workers", "3000"), "Corpus too small: a shard of 26 tokens"),
    (("--arms", "adamw,distro:overlap=maybe"), "Invalid value 'maybe' for option 'overlap'"),
    (("--arms", "adamw,adamw:"), "'adamw' and 'adamw:' would share result files"),
])
def test_bad_value_is_refused_before_the_run_directory_is_written(corpus, tmp_path, capsys, flags, message):
    assert run.main(tiny_args(corpus, tmp_path / "x", extra=flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not (tmp_path / "x").exists()


def test_torch_threads_are_capped_where_thread_creation_would_fail():
    preset = get_preset("smoke")
    preset.torch_threads = 100_000  # segfaults inside torch.set_num_threads
    with pytest.raises(ValueError, match="Invalid torch_threads: 100000 .* to 1024"):
        preset.validate()


def test_unusable_output_dir_is_a_one_line_error(corpus, tmp_path, capsys):
    (tmp_path / "file").write_text("in the way")
    assert run.main(tiny_args(corpus, tmp_path / "file" / "run")) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: cannot use {tmp_path / 'file' / 'run'}: Not a directory"
    assert (tmp_path / "file").read_text() == "in the way"


def _files(directory):
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("config", ["[]", "{}", '{"preset": [], "arms": [], "seeds": [], "workers": 2}'])
def test_resume_of_a_config_of_another_shape_is_refused_and_left_alone(corpus, straight, tmp_path, capsys,
                                                                       config):
    shutil.copytree(straight, tmp_path / "run")
    (tmp_path / "run" / "config.json").write_text(config)
    before = _files(tmp_path / "run")
    assert run.main(tiny_args(corpus, tmp_path / "run", steps=40, extra=("--resume",))) == 2
    assert "holds an unreadable config.json" in capsys.readouterr().err
    assert _files(tmp_path / "run") == before


def test_resume_with_a_damaged_metrics_row_names_the_file_and_line(corpus, straight, tmp_path, capsys):
    shutil.copytree(straight, tmp_path / "run")
    metrics = tmp_path / "run" / "metrics.jsonl"
    line = len(metrics.read_text().splitlines()) + 1
    with open(metrics, "a") as f:
        f.write("[1, 2]\n")
    before = _files(tmp_path / "run")
    assert run.main(tiny_args(corpus, tmp_path / "run", steps=40, extra=("--resume",))) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {metrics} is damaged: line {line} is not a metrics row ('[1, 2]')"
    assert _files(tmp_path / "run") == before


def test_resume_with_the_metrics_removed_is_a_one_line_error(corpus, straight, tmp_path, capsys):
    shutil.copytree(straight, tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").unlink()
    assert run.main(tiny_args(corpus, tmp_path / "run", steps=40, extra=("--resume",))) == 2
    assert "metrics.jsonl holds no rows of arm 'adamw' seed 0" in capsys.readouterr().err


def _truncate_rank1(run_dir):
    path = run_dir / "checkpoints" / "distro-seed0" / "step36.rank1.pt"
    path.write_bytes(path.read_bytes()[:100])
    return path, "is unreadable (RuntimeError: PytorchStreamReader failed reading zip archive"


def _put_adamws_file_in_distros_folder(run_dir):
    path = run_dir / "checkpoints" / "distro-seed0" / "step36.rank0.pt"
    shutil.copy(run_dir / "checkpoints" / "adamw-seed0" / "step36.rank0.pt", path)
    # refused by DisTrOAdamW.load_state_dict itself (the runner compares the names for torch's AdamW)
    return path, ("does not fit this model and optimizer "
                  "(ValueError: checkpoint's param group 0 lacks compression_bits, ")


@pytest.mark.parametrize("damage", [_truncate_rank1, _put_adamws_file_in_distros_folder],
                         ids=["truncated", "another-arms-file"])
def test_resume_from_a_bad_checkpoint_names_the_file_before_any_arm_trains(corpus, straight, tmp_path, capsys,
                                                                           damage):
    shutil.copytree(straight, tmp_path / "run")
    for result in (tmp_path / "run" / "results").iterdir():
        result.unlink()  # both arms to resume: adamw, whose files are fine, would train first
    path, problem = damage(tmp_path / "run")
    before = _files(tmp_path / "run")
    assert run.main(tiny_args(corpus, tmp_path / "run", steps=40, extra=("--resume",))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint {path} {problem}")
    assert err[0].endswith(f"; move the step36.rank*.pt files out of {path.parent} to resume from step 32")
    assert _files(tmp_path / "run") == before


@pytest.fixture(scope="module")
def straight_without_alone(corpus, tmp_path_factory):
    """``straight`` as a torchrun job trains it: the runner adds the alone arm only in-process."""
    out = tmp_path_factory.mktemp("runs") / "straight-without-alone"
    assert run.main(tiny_args(corpus, out, steps=40, extra=("--no-alone",))) == 0
    return out


def test_torch_distributed_resume_from_a_bad_checkpoint_is_a_one_line_error_on_every_rank(
        corpus, straight_without_alone, tmp_path):
    shutil.copytree(straight_without_alone, tmp_path / "run")
    for result in (tmp_path / "run" / "results").iterdir():
        result.unlink()
    path, problem = _truncate_rank1(tmp_path / "run")
    before = _files(tmp_path / "run")
    args = tiny_args(corpus, tmp_path / "run", steps=40, extra=("--resume",))
    for code, err in _run_two_ranks(args, tmp_path):
        assert code == 2 and err.strip().startswith(f"error: checkpoint {path} {problem}"), err
        assert len(err.strip().splitlines()) == 1, err
    assert _files(tmp_path / "run") == before


def test_torn_result_file_does_not_count_as_finished_and_the_arm_is_run_again(corpus, straight, tmp_path):
    shutil.copytree(straight, tmp_path / "run")
    (tmp_path / "run" / "results" / "adamw-seed0.json").write_text('{"arm": "adamw", "se')
    assert run.main(tiny_args(corpus, tmp_path / "run", steps=40, extra=("--resume",))) == 0
    result = json.loads((tmp_path / "run" / "results" / "adamw-seed0.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result["status"] == "done" and "adamw" in summary["arms"]
    assert comparable(read_metrics(tmp_path / "run" / "metrics.jsonl")) == comparable(
        read_metrics(straight / "metrics.jsonl")
    )


def test_result_write_cut_short_leaves_no_result_file(tmp_path, monkeypatch):
    (tmp_path / "results").mkdir()
    (arm,) = parse_arms("adamw")
    worker = {"rank": 0, "world_size": 1, "status": "done", "payload_nbytes": 4, "n_params": 1,
              "sent": 0, "received": 0, "collectives": 0, "check_sent": 0, "check_received": 0,
              "checks": 0, "wall_s": 0.0}

    def cut_short(path, text, *args, **kwargs):  # a kill or a full disk halfway through the write
        with open(path, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_text", cut_short)
    with pytest.raises(OSError):
        run.record_result(tmp_path, SimpleNamespace(arm=arm, seed=0), [worker])
    assert not (tmp_path / "results" / "adamw-seed0.json").exists()


def test_output_dir_holding_a_different_run_is_refused_and_left_alone(corpus, straight, capsys):
    before = {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()}
    assert run.main(tiny_args(corpus, straight, steps=41, extra=("--resume",))) == 2
    assert "holds a different run (differs in: steps)" in capsys.readouterr().err
    assert run.main(tiny_args(corpus, straight, steps=40)) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()} == before


def _hold_lock_in_another_process(directory):
    """A process that holds ``directory``'s run lock until it is killed (as a running run does)."""
    code = (
        "import sys, time\n"
        "from distro_opt.experiments.files import lock_directory\n"
        "lock = lock_directory(sys.argv[1])\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.timeout(120)
def test_a_second_run_in_a_directory_in_use_is_refused_and_leaves_it_alone(corpus, straight, tmp_path,
                                                                           capsys):
    out = tmp_path / "busy"
    shutil.copytree(straight, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    holder = _hold_lock_in_another_process(out)
    try:
        assert run.main(tiny_args(corpus, out, steps=40, extra=("--resume",))) == 2
        assert f"{out} is in use by another run" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert run.main(tiny_args(corpus, out, steps=40, extra=("--resume",))) == 0  # free once it ended


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


def test_grad_clip_changes_both_arms_only_where_it_binds(corpus, straight, tmp_path):
    """A norm no gradient reaches leaves every arm's run bit for bit as without clipping; a small
    one changes both AdamW (its averaged gradient) and distro (each worker's own)."""
    straight_rows = comparable(read_metrics(straight / "metrics.jsonl"))
    assert run.main(tiny_args(corpus, tmp_path / "loose", steps=40, extra=("--grad-clip", "1e9"))) == 0
    assert comparable(read_metrics(tmp_path / "loose" / "metrics.jsonl")) == straight_rows
    assert run.main(tiny_args(corpus, tmp_path / "tight", steps=40, extra=("--grad-clip", "0.05"))) == 0
    tight = json.loads((tmp_path / "tight" / "summary.json").read_text())["arms"]
    loose = json.loads((straight / "summary.json").read_text())["arms"]
    for arm in ("adamw", "distro"):
        assert tight[arm]["final_val_loss_mean"] != loose[arm]["final_val_loss_mean"]


def test_both_arms_learn_on_the_tiny_corpus(straight):
    summary = json.loads((straight / "summary.json").read_text())
    for arm in ("adamw", "distro"):
        assert summary["arms"][arm]["final_val_loss_mean"] < summary["arms"][arm]["initial_val_loss"] - 0.5


def _tiny_model():
    """The model ``tiny_args`` trains (TINY_TRANSFORMER_FLAGS, byte tokens, 32-token context)."""
    cfg = type(get_preset("smoke").model_config())(
        vocab_size=256, n_layers=1, d_model=32, n_heads=2, d_ff=64, max_seq_len=32
    )
    return build_model(cfg, seed=0)


def test_reported_bytes_equal_backend_counters_and_codec_formula(corpus, straight):
    summary = json.loads((straight / "summary.json").read_text())
    results = {p.stem: json.loads(p.read_text()) for p in (straight / "results").glob("*.json")}
    opt = DisTrOAdamW(_tiny_model().parameters(), comm=SingleWorkerBackend())
    n_params = sum(p.numel() for p in _tiny_model().parameters())
    expected = {
        "distro": CommStats.all_gather_bytes(opt.payload_nbytes, 2),
        "adamw": CommStats.ring_all_reduce_bytes(4 * n_params, 2),
    }
    for arm, per_step in expected.items():
        assert summary["arms"][arm]["sent_bytes_per_step"] == per_step
        assert summary["arms"][arm]["received_bytes_per_step"] == per_step
        assert [w["sent"] for w in results[f"{arm}-seed0"]["workers"]] == [40 * per_step] * 2
        assert summary["arms"][arm]["bytes_match_formula"] is True
    # the replica check of the first step, counted apart from the per-step payload
    check = CommStats.all_gather_bytes(CHECKSUM_NBYTES, 2)
    assert [(w["checks"], w["check_sent"], w["check_received"]) for w in results["distro-seed0"]["workers"]] == [
        (1, check, check)
    ] * 2
    assert summary["arms"]["distro"]["per_seed"]["0"]["replica_check_sent_bytes"] == check
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
    proc = subprocess.Popen(cmd, cwd=out.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=default_sigint)
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


# overlap: the update of the step before lands after the save; a compression warm-up (20 steps):
# interrupted inside it, the resumed run must pick the warm-up up where it was, and its ledger
@pytest.mark.parametrize("arm", ["distro:overlap=true", "distro:warmup_for=20,warmup_topk=16"])
def test_interrupted_overlap_or_warmup_run_resumes_to_the_same_numbers(corpus, tmp_path, arm):
    extra = ("--arms", arm)
    assert run.main(tiny_args(corpus, tmp_path / "straight", steps=40, extra=extra)) == 0
    out = tmp_path / "interrupted"
    args = tiny_args(corpus, out, steps=40, extra=extra)
    rc, err = _run_and_interrupt(args, out, signal.SIGINT, after_rows=15)
    assert rc == 130, err
    _resume(args, tmp_path)
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(
        read_metrics(tmp_path / "straight" / "metrics.jsonl")
    )
    # the resumed workers compared their replicas again: two checks, and the ledger still exact
    summary = json.loads((out / "summary.json").read_text())
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert summary["arms"][arm]["per_seed"]["0"]["replica_checks"] == 2
    assert summary["arms"][arm]["bytes_match_formula"] is True
    assert summary["arms"][arm]["compression_vs_dense_bf16"] == straight["arms"][arm]["compression_vs_dense_bf16"]


def test_demo_and_option_arms_report_their_own_payload(corpus, tmp_path):
    out = tmp_path / "arms"
    assert run.main(tiny_args(corpus, out, steps=4, extra=("--arms", "demo,distro:topk=8,bits=2"))) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reference"] is None
    demo, distro = summary["arms"]["demo"], summary["arms"]["distro:topk=8,bits=2"]
    assert demo["sent_bytes_per_step"] == CommStats.all_gather_bytes(demo["payload_nbytes"], 2)
    assert distro["payload_nbytes"] < demo["payload_nbytes"]  # 2-bit values vs DeMo's float32
    assert demo["bytes_match_formula"] and distro["bytes_match_formula"]


def test_compression_warmup_arm_counts_its_larger_first_payloads(corpus, tmp_path):
    """``warmup_for=3,warmup_topk=16``: 3 steps at the top-16 payload, then the default one; the
    backend's counters, the ledger and the compression all say so."""
    out = tmp_path / "warm"
    arms = "distro,distro:warmup_for=3,warmup_topk=16"
    assert run.main(tiny_args(corpus, out, steps=8, extra=("--arms", arms))) == 0
    summary = json.loads((out / "summary.json").read_text())["arms"]
    plain, warm = summary["distro"], summary["distro:warmup_for=3,warmup_topk=16"]
    top16 = DisTrOAdamW(_tiny_model().parameters(), compression_topk=16).payload_nbytes
    assert warm["payload_nbytes"] == plain["payload_nbytes"] < top16
    per_step = (3 * top16 + 5 * plain["payload_nbytes"]) / 8
    assert warm["sent_bytes_per_step"] == (3 * CommStats.all_gather_bytes(top16, 2)
                                           + 5 * CommStats.all_gather_bytes(plain["payload_nbytes"], 2)) / 8
    assert warm["bytes_match_formula"] is True
    assert warm["compression_vs_dense_bf16"] == pytest.approx(plain["compression_vs_dense_bf16"]
                                                             * plain["payload_nbytes"] / per_step)


@pytest.mark.parametrize("arms, message", [
    ("distro:warmup_topk=16", "warmup_topk and warmup_bits need warmup_for"),
    ("distro:warmup_for=-2,warmup_topk=16", "Invalid warm-up steps: -2"),
    ("adamw:warmup_for=2", "Unknown option 'warmup_for' for arm 'adamw'"),
])
def test_bad_compression_warmup_arm_is_refused_in_one_line(corpus, tmp_path, capsys, arms, message):
    assert run.main(tiny_args(corpus, tmp_path / "x", extra=("--arms", arms))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_bad_arm_is_reported_before_the_presets_own_settings(tmp_path, capsys):
    # --steps 2 also leaves the preset's warm-up (30 steps) invalid: the arm the user typed comes first
    assert run.main(["--steps", "2", "--arms", "bogus", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "Unknown arm 'bogus'" in err and "warmup" not in err


def test_resume_without_a_run_is_an_error(corpus, tmp_path, capsys):
    assert run.main(tiny_args(corpus, tmp_path / "none", extra=("--resume",))) == 2
    assert "nothing to resume" in capsys.readouterr().err


def _run_two_ranks(args, tmp_path):
    """The runner as two torch.distributed ranks (as torchrun starts them); [(exit code, stderr)]."""
    procs, rendezvous = [], tmp_path / f"rendezvous{time.monotonic_ns()}"  # no TCP store
    for rank in range(2):
        env = {**os.environ, **one_machine_env(rank, 2, rendezvous)}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "distro_opt.experiments.run", *args],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return wait_all(procs, 240)


def test_torch_distributed_ranks_train_like_in_process_workers(corpus, straight_without_alone, tmp_path):
    straight = straight_without_alone
    out = tmp_path / "dist"
    for code, err in _run_two_ranks(tiny_args(corpus, out, steps=40), tmp_path):
        assert code == 0, err
    losses = {k: v[:2] for k, v in comparable(read_metrics(out / "metrics.jsonl")).items()}
    assert losses == {k: v[:2] for k, v in comparable(read_metrics(straight / "metrics.jsonl")).items()}
    dist_summary = json.loads((out / "summary.json").read_text())
    local_summary = json.loads((straight / "summary.json").read_text())
    # Gloo's all_reduce carries a flag element (4 bytes) and agreed on the shape once (a 64-byte
    # descriptor, all-gathered) so that ranks whose tensors differ all raise: counted as sent
    overhead = CommStats.ring_all_reduce_bytes(4, 2) + CommStats.all_gather_bytes(DESCRIPTOR_BYTES, 2) / 40
    assert dist_summary["arms"]["adamw"]["sent_bytes_per_step"] == pytest.approx(
        local_summary["arms"]["adamw"]["sent_bytes_per_step"] + overhead, rel=0, abs=1e-9
    )
    # The torch backend frames each payload (a length prefix it counts as sent): never less than the formula.
    assert dist_summary["arms"]["distro"]["per_seed"]["0"]["sent_minus_formula_bytes_per_step"] >= 0
