"""research/gpu_parity.sh, the GPU check of the parity study, at CPU size: the command a GPU session
runs, with the same arms and flags, so that it is known to work before device time is spent on it."""
import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "research" / "gpu_parity.sh"


def test_the_gpu_script_runs_its_three_arms_at_tiny_size(corpus, tmp_path):
    folder, cache = corpus
    out = tmp_path / "gpu"
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out), "--tiny", "--corpus", str(folder), "--cache", str(cache),
         "--tokenizer", "byte", "--no-plots", "--timeout-s", "60"],
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["preset"]["autocast"] == "bf16" and config["workers"] == 4
    assert [a["kind"] for a in config["arms"]] == ["adamw", "distro", "distro"]
    assert config["arms"][2]["options"]["sync_every"] == 16
    for arm in summary["arms"].values():
        assert arm["bytes_match_formula"]
        assert arm["final_val_loss_mean"] < arm["initial_val_loss"]
