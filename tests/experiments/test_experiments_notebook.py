"""The bandwidth-vs-loss notebook executes top to bottom against a tiny run, so it never rots."""

from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from distro_opt.experiments import data, run
from distro_opt.experiments.plots import PLOT_FILES

from _models import TINY_TRANSFORMER_FLAGS

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "bandwidth_vs_loss.ipynb"


def test_notebook_shows_the_table_and_plots_of_a_run(tmp_path, monkeypatch):
    folder = tmp_path / "texts"
    folder.mkdir()
    rng = np.random.default_rng(0)
    (folder / "t.txt").write_text(
        " ".join(["to", "be", "or", "not"][i] for i in rng.integers(0, 4, size=5000))
    )
    data.prepare(str(folder), "byte", cache=tmp_path / "cache")
    out = tmp_path / "run"
    args = [
        "--out",
        str(out),
        "--cache",
        str(tmp_path / "cache"),
        "--corpus",
        str(folder),
        "--tokenizer",
        "byte",
        "--workers",
        "2",
        *TINY_TRANSFORMER_FLAGS,
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--steps",
        "6",
        "--warmup-steps",
        "1",
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--eval-batch-size",
        "2",
        "--no-progress",
        "--no-plots",
    ]
    assert run.main(args) == 0
    monkeypatch.setenv("DISTRO_OPT_RUN", str(out))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel starts outside the repository root: comm/ there must not shadow Jupyter's 'comm'.
    NotebookClient(
        nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    markdown = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert len(markdown) == 1 and "| adamw |" in markdown[0] and "| distro |" in markdown[0]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == len(PLOT_FILES)
    assert (out / "val_loss_vs_bytes.png").exists() and (out / "retained_gain_vs_bytes.png").exists()


def test_a_missing_run_directory_says_what_to_point_at(tmp_path):
    from distro_opt.experiments.metrics import load_run

    for run_dir, what in ((tmp_path / "missing", "does not exist"), (tmp_path, "holds no config.json")):
        with pytest.raises(FileNotFoundError) as raised:
            load_run(run_dir)
        assert f"{run_dir} {what}: it is not a run directory" in str(raised.value)
        assert "python -m experiments.run" in str(raised.value) and "DISTRO_OPT_RUN" in str(raised.value)
