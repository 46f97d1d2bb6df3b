"""The alone baseline and the retained gain R: one worker training AdamW by itself, no network, and
how much of data parallelism's gain each arm keeps (background.md, "worth the network")."""
import json

import pytest
from _models import tiny_args

from distro_opt.experiments import frontier, run
from distro_opt.experiments.arms import parse_arms, with_alone
from distro_opt.experiments.gains import retained_gain_pct
from distro_opt.experiments.presets import get_preset
from distro_opt.experiments.sweep import tuned_summary


def _labels(arms):
    return [a.label for a in arms]


def test_the_alone_arm_follows_the_first_adamw_arm_with_its_options():
    arms = with_alone(parse_arms("distro,adamw:lr=0.002,adamw"), workers=4)
    assert _labels(arms) == ["distro", "adamw:lr=0.002", "alone:lr=0.002", "adamw"]
    assert arms[2].kind == "alone" and arms[2].options == {"lr": 0.002}


def test_the_alone_arm_is_added_only_where_r_can_be_measured():
    assert _labels(with_alone(parse_arms("adamw,distro"), workers=1)) == ["adamw", "distro"]  # no data parallelism
    assert _labels(with_alone(parse_arms("distro"), workers=4)) == ["distro"]  # no data-parallel AdamW
    assert _labels(with_alone(parse_arms("adamw,alone,distro"), workers=4)) == ["adamw", "alone", "distro"]


def test_retained_gain_matches_the_definition_on_the_issues_numbers():
    # smoke, 4 workers, seed 0: alone 4.890, data-parallel AdamW 4.489 (G = 0.401)
    assert retained_gain_pct(5.070, 4.890, 4.489) == pytest.approx(100 * (4.890 - 5.070) / 0.401)
    assert retained_gain_pct(4.489, 4.890, 4.489) == pytest.approx(100.0)
    assert retained_gain_pct(4.890, 4.890, 4.489) == 0.0
    assert retained_gain_pct(5.0, 4.4, 4.5) is None  # alone beat data parallelism: no gain to retain


def _arm_summary(losses):
    return {"final_val_loss_mean": sum(losses.values()) / len(losses), "seeds": [int(s) for s in losses],
            "per_seed": {s: {"final_val_loss": v} for s, v in losses.items()},
            "compression_vs_dense_bf16": None, "sent_bytes_per_step": 0.0}


def test_a_sweep_measures_r_from_the_tuned_alone_and_the_tuned_adamw():
    arms = [{"label": f"{b}@lr={p}", "kind": b, "base": b, "point": {"lr": p}}
            for b in ("adamw", "alone", "distro") for p in ("1x", "2x")]
    summary = {
        "adamw@lr=1x": _arm_summary({"0": 4.0, "1": 4.2}), "adamw@lr=2x": _arm_summary({"0": 4.1, "1": 4.3}),
        "alone@lr=1x": _arm_summary({"0": 5.0, "1": 5.1}), "alone@lr=2x": _arm_summary({"0": 4.8, "1": 4.9}),
        "distro@lr=1x": _arm_summary({"0": 4.6, "1": 4.5}), "distro@lr=2x": _arm_summary({"0": 4.7, "1": 4.8}),
    }
    tuned = tuned_summary(arms, summary, [0, 1])
    assert tuned["alone"] == "alone" and tuned["arms"]["alone"]["point"] == {"lr": "2x"}
    r = tuned["arms"]["distro"]["retained_gain_pct_per_seed"]
    assert r == pytest.approx([100 * (4.8 - 4.6) / (4.8 - 4.0), 100 * (4.9 - 4.5) / (4.9 - 4.2)])
    assert tuned["arms"]["distro"]["retained_gain_pct_mean"] == pytest.approx(sum(r) / 2)


@pytest.fixture(scope="module")
def compared(corpus, tmp_path_factory):
    """A 2-worker run of AdamW and the defaults, to which the runner adds the alone arm."""
    out = tmp_path_factory.mktemp("alone") / "run"
    assert run.main(tiny_args(corpus, out, steps=12, extra=("--seeds", "0,1"))) == 0
    return out


def test_a_run_of_several_workers_trains_the_alone_arm_on_one_worker_with_no_traffic(compared):
    config = json.loads((compared / "config.json").read_text())
    assert [a["label"] for a in config["arms"]] == ["adamw", "alone", "distro"]
    result = json.loads((compared / "results" / "alone-seed0.json").read_text())
    assert result["world_size"] == 1 and len(result["workers"]) == 1
    assert result["workers"][0]["sent"] == result["workers"][0]["received"] == 0
    alone = json.loads((compared / "summary.json").read_text())["arms"]["alone"]
    assert alone["sent_bytes_per_step"] == 0 and alone["compression_vs_dense_bf16"] is None
    assert alone["tokens"] * 2 == json.loads((compared / "summary.json").read_text())["arms"]["adamw"]["tokens"]


def test_the_alone_arm_is_adamw_run_by_one_worker(corpus, compared, tmp_path):
    """The reference is independent of the alone code path: a one-worker run of plain AdamW."""
    single = tmp_path / "single"
    args = tiny_args(corpus, single, steps=12, extra=("--seeds", "0,1", "--arms", "adamw", "--no-alone"))
    args[args.index("--workers") + 1] = "1"
    assert run.main(args) == 0
    alone = json.loads((compared / "summary.json").read_text())["arms"]["alone"]["per_seed"]
    adamw = json.loads((single / "summary.json").read_text())["arms"]["adamw"]["per_seed"]
    assert [alone[s]["final_val_loss"] for s in ("0", "1")] == [adamw[s]["final_val_loss"] for s in ("0", "1")]


def test_every_arm_reports_r_per_seed_against_alone_and_data_parallel_adamw(compared):
    summary = json.loads((compared / "summary.json").read_text())
    loss = {label: {s: a["per_seed"][s]["final_val_loss"] for s in ("0", "1")} for label, a in summary["arms"].items()}
    assert summary["alone"] == "alone" and summary["reference"] == "adamw"
    for s in ("0", "1"):
        assert summary["data_parallel_gain_per_seed"][s] == pytest.approx(loss["alone"][s] - loss["adamw"][s])
    gains = summary["data_parallel_gain_per_seed"]
    want = [100 * (loss["alone"][s] - loss["distro"][s]) / gains[s] if gains[s] > 0 else None for s in ("0", "1")]
    assert summary["arms"]["distro"]["retained_gain_pct_per_seed"] == pytest.approx(want)
    table = (compared / "summary.md").read_text()
    assert "R (retained gain)" in table and "| alone |" in table


def test_no_alone_leaves_the_run_without_it(corpus, tmp_path):
    out = tmp_path / "run"
    assert run.main(tiny_args(corpus, out, steps=4, extra=("--no-alone",))) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {"adamw", "distro"}
    assert summary["arms"]["distro"]["retained_gain_pct_per_seed"] == []
    assert "R (retained gain): not measured here" in (out / "summary.md").read_text()


def test_the_frontier_carries_r_and_pairs_it_across_runs(corpus, compared, tmp_path):
    other = tmp_path / "distro-only"
    assert run.main(tiny_args(corpus, other, steps=12, extra=("--seeds", "0,1", "--arms", "distro:topk=2"))) == 0
    points = frontier.pair_with_adamw([p for r in (compared, other) for p in frontier.load_points(r)])
    paired = next(p for p in points if p["arm"] == "distro:topk=2")
    summary = json.loads((compared / "summary.json").read_text())
    gains = summary["data_parallel_gain_per_seed"]
    alone = summary["arms"]["alone"]["per_seed"]
    want = [100 * (alone[s]["final_val_loss"] - paired["loss_per_seed"][s]) / gains[s] for s in ("0", "1")]
    assert paired["r_per_seed"] == pytest.approx(want)
    assert frontier.main([str(compared), str(other), "--out", str(tmp_path / "f")]) == 0
    assert "R, retained gain" in (tmp_path / "f" / "frontier.md").read_text()


def test_the_volunteer_preset_spreads_smokes_global_batch_over_16_workers():
    smoke, volunteer = get_preset("smoke"), get_preset("volunteer")
    assert (volunteer.workers, volunteer.batch_size, volunteer.seq_len) == (16, 1, 128)
    tokens = lambda p: p.workers * p.batch_size * p.seq_len  # noqa: E731
    assert tokens(volunteer) == tokens(smoke) == 2048
    assert (volunteer.steps, volunteer.d_model, volunteer.sharding) == (smoke.steps, smoke.d_model, "contiguous")


def test_the_alone_arm_under_torchrun_is_refused_naming_the_in_process_way(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run.main(tiny_args(corpus, tmp_path / "x", extra=("--arms", "adamw,alone"))) == 2
    assert "the alone arm (one worker, no network) runs in-process" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
