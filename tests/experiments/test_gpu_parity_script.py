"""research/gpu_parity.sh and research/gpu_session.sh, the GPU session's measurements, at CPU size:
the commands a GPU session runs, with the same arms and flags, so that they are known to work
before device time is spent on them."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARITY = ROOT / "research" / "gpu_parity.sh"
SESSION = ROOT / "research" / "gpu_session.sh"
ENV = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
TRANSFER_LIMIT = 64 * 2**20  # what comes back from the device machine


def _runner_flags(corpus):
    folder, cache = corpus
    return ["--corpus", str(folder), "--cache", str(cache), "--tokenizer", "byte", "--timeout-s", "60"]


def test_the_gpu_script_runs_its_arms_and_the_alone_baseline_at_tiny_size(corpus, tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run(["bash", str(PARITY), str(out), "--tiny", *_runner_flags(corpus), "--no-plots"],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["preset"]["autocast"] == "bf16" and config["workers"] == 4
    assert [a["kind"] for a in config["arms"]] == ["adamw", "alone", "distro", "distro", "distro"]
    assert config["arms"][3]["options"]["compression_decay"] == 0.9
    assert config["arms"][4]["options"]["sync_every"] == 16
    for arm in summary["arms"].values():
        assert arm["bytes_match_formula"]
        assert arm["final_val_loss_mean"] < arm["initial_val_loss"]
    assert summary["arms"]["distro"]["retained_gain_pct_per_seed"]  # R measured against alone


def test_the_session_script_runs_both_parts_into_one_folder_that_fits_the_transfer(corpus, tmp_path):
    out = tmp_path / "session"
    done = subprocess.run(["bash", str(SESSION), str(out), "--tiny", *_runner_flags(corpus)],
                          env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    status = (out / "status.txt").read_text()
    assert "parity rc=0" in status and "check rc=0" in status
    assert "torch" in (out / "env.txt").read_text()
    assert json.loads((out / "parity" / "summary.json").read_text())["alone"] == "alone"
    assert "AdamW" in (out / "check.log").read_text()  # bench_step's table, against torch's AdamW
    assert not (out / "parity" / "checkpoints").exists()
    assert sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) < TRANSFER_LIMIT
    again = subprocess.run(["bash", str(SESSION), str(out), "--tiny"], env=ENV, capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 2 and "not empty" in again.stderr  # nothing of the first session is overwritten
