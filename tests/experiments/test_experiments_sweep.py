"""--sweep: every arm at every point of one grid, and the best point of each against AdamW's best."""
import json

import pytest

from distro_opt.experiments import frontier, run
from distro_opt.experiments.arms import parse_arms
from distro_opt.experiments.sweep import expand, parse_sweep, tuned_summary

from _models import tiny_args


def test_grid_values_are_multiples_or_numbers():
    grid = parse_sweep("lr=0.5x,1x,3e-3; outer_lr=0.7,1")
    assert [(v.value, v.relative) for v in grid["lr"]] == [(0.5, True), (1.0, True), (0.003, False)]
    assert [v.apply(2.0) for v in grid["outer_lr"]] == [0.7, 1.0]
    assert parse_sweep("") == {}


@pytest.mark.parametrize("text, message", [
    ("lr", "is not key=v1"),
    ("beta1=1x", "unknown key 'beta1'"),
    ("lr=1x;lr=2x", "given twice"),
    ("lr=1x,1x", "listed twice"),
    ("lr=0x", "positive"),
    ("lr=-1", "positive"),
    ("lr=fast", "positive"),
    ("lr=1x,", "positive"),
])
def test_bad_grids_are_refused_naming_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        parse_sweep(text)


def test_each_arm_runs_every_point_with_its_own_lr_scaled():
    arms = parse_arms("adamw,distro:lr=0.002,norm.lr=0.0005,distro:sync_every=4,outer_lr=0.5")
    out = expand(arms, parse_sweep("lr=1x,3x;outer_lr=2x,0.7"), preset_lr=0.001)
    by_label = {a.label: a for a in out}
    assert by_label["adamw@lr=3x"].options["lr"] == pytest.approx(0.003)
    scaled = by_label["distro:lr=0.002,norm.lr=0.0005@lr=3x"].options
    assert scaled["lr"] == pytest.approx(0.006) and scaled["norm.lr"] == pytest.approx(0.0015)
    local = by_label["distro:sync_every=4,outer_lr=0.5@lr=1x,outer_lr=2x"]
    assert local.options["outer_lr"] == pytest.approx(1.0) and local.options["lr"] == pytest.approx(0.001)
    # the outer lr is swept only where there is an outer step: 2 + 2 + 2 x 2 points
    assert len(out) == 8
    assert {a.base for a in out} == {a.label for a in arms}
    assert local.point == {"lr": "1x", "outer_lr": "2x"}


def _arm_summary(losses: dict, ratio=100.0):
    return {
        "seeds": list(map(int, losses)),
        "per_seed": {s: {"final_val_loss": v} for s, v in losses.items()},
        "final_val_loss_mean": sum(losses.values()) / len(losses),
        "compression_vs_dense_bf16": ratio,
        "sent_bytes_per_step": 1.0,
    }


def test_the_point_with_the_lowest_mean_loss_is_chosen_and_paired_per_seed():
    arms = [
        {"label": f"{base}@lr={p}", "kind": kind, "base": base, "point": {"lr": p}}
        for base, kind in (("adamw", "adamw"), ("distro", "distro")) for p in ("1x", "2x", "4x")
    ]
    summary = {
        "adamw@lr=1x": _arm_summary({"0": 4.0, "1": 4.2}),
        "adamw@lr=2x": _arm_summary({"0": 3.9, "1": 4.1}),
        "adamw@lr=4x": _arm_summary({"0": 3.8}),  # one seed only: not a candidate
        "distro@lr=1x": _arm_summary({"0": 4.5, "1": 4.1}),  # best on seed 1, not on the mean
        "distro@lr=2x": _arm_summary({"0": 4.2, "1": 4.3}),
        "distro@lr=4x": _arm_summary({"0": 4.4, "1": 4.4}),
    }
    tuned = tuned_summary(arms, summary, [0, 1])
    assert tuned["reference"] == "adamw"
    assert tuned["arms"]["adamw"]["point"] == {"lr": "2x"}
    distro = tuned["arms"]["distro"]
    assert distro["point"] == {"lr": "2x"} and distro["at_grid_edge"] == []
    assert distro["gap_vs_tuned_adamw_pct_per_seed"] == pytest.approx([100 * (4.2 / 3.9 - 1), 100 * (4.3 / 4.1 - 1)])
    assert tuned_summary([{"label": "adamw", "kind": "adamw", "base": "", "point": {}}], {}, [0]) is None


def test_a_winner_on_the_edge_of_the_grid_is_flagged():
    arms = [{"label": f"a@lr={p}", "kind": "adamw", "base": "a", "point": {"lr": p}} for p in ("1x", "2x")]
    summary = {"a@lr=1x": _arm_summary({"0": 4.0}), "a@lr=2x": _arm_summary({"0": 3.0})}
    assert tuned_summary(arms, summary, [0])["arms"]["a"]["at_grid_edge"] == ["lr"]


def test_a_sweep_run_reports_the_tuned_points_in_summary_and_frontier(corpus, tmp_path, capsys):
    out = tmp_path / "sweep"
    args = tiny_args(corpus, out, steps=8, extra=["--sweep", "lr=1x,4x", "--seeds", "0,1"])
    assert run.main(args) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {f"{base}@lr={p}" for base in ("adamw", "alone", "distro") for p in ("1x", "4x")}
    assert summary["reference"] == "adamw@lr=1x"  # the untuned table: against AdamW at its own lr
    tuned = summary["tuned"]
    for base in ("adamw", "distro"):
        points = {p: summary["arms"][f"{base}@lr={p}"]["final_val_loss_mean"] for p in ("1x", "4x")}
        assert tuned["arms"][base]["point"] == {"lr": min(points, key=points.get)}
    assert "Tuned, best vs best" in printed and f"| distro | lr={tuned['arms']['distro']['point']['lr']}" in printed
    assert frontier.main([str(out), "--out", str(tmp_path / "frontier")]) == 0
    table = (tmp_path / "frontier" / "frontier.md").read_text()
    assert "`distro (tuned: lr=" in table and table.count("| sweep |") == 3  # adamw, alone, distro


def test_a_bad_sweep_is_a_one_line_error_before_the_run_directory_exists(corpus, tmp_path, capsys):
    out = tmp_path / "bad"
    assert run.main(tiny_args(corpus, out, extra=["--sweep", "lr=2y"])) == 2
    assert "'2y' is not a positive number" in capsys.readouterr().err
    assert not out.exists()


def test_tuned_points_pair_only_with_a_tuned_adamw_of_another_run(corpus, tmp_path):
    def make(name, arms, sweep):
        extra = ["--arms", arms, "--seeds", "0"] + (["--sweep", sweep] if sweep else [])
        assert run.main(tiny_args(corpus, tmp_path / name, steps=6, extra=extra)) == 0
        return str(tmp_path / name)

    tuned_adamw = make("tuned-adamw", "adamw", "lr=1x,2x")
    tuned_distro = make("tuned-distro", "distro:sync_every=2", "lr=1x,2x;outer_lr=1")
    plain_adamw = make("plain-adamw", "adamw", "")
    points = frontier.pair_with_adamw(
        [p for r in (tuned_distro, plain_adamw) for p in frontier.load_points(tmp_path / r)])
    distro = next(p for p in points if p["mode"] != "adamw")
    assert distro["gap_pct"] is None  # an untuned AdamW is no reference for a tuned arm
    points = frontier.pair_with_adamw(
        [p for r in (tuned_distro, tuned_adamw) for p in frontier.load_points(tmp_path / r)])
    distro = next(p for p in points if p["mode"] != "adamw")
    best_adamw = json.loads((tmp_path / "tuned-adamw" / "summary.json").read_text())["tuned"]["arms"]["adamw"]
    expected = 100 * (distro["val_loss"] / best_adamw["final_val_loss_per_seed"]["0"] - 1)
    assert distro["gap_pct"] == pytest.approx(expected)


def test_diloco_sweeps_its_outer_lr_from_its_own_recipe_and_peer_arms_their_lr():
    out = expand(parse_arms("diloco:H=8,powersgd:rank=2"), parse_sweep("lr=2x;outer_lr=1x,0.5"), preset_lr=0.001)
    by_label = {a.label: a for a in out}
    assert by_label["diloco:H=8@lr=2x,outer_lr=1x"].options["outer_lr"] == pytest.approx(0.7)
    assert by_label["diloco:H=8@lr=2x,outer_lr=0.5"].options["outer_lr"] == 0.5
    assert by_label["powersgd:rank=2@lr=2x"].options["lr"] == pytest.approx(0.002)
    assert len(out) == 3
