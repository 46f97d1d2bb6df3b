"""experiments.frontier turns run summaries into a gap-vs-compression table and plot."""
import json

import pytest

from distro_opt.experiments import frontier


def write_run(path, arms, seeds=(0, 1), steps=300):
    """A finished run directory with the fields experiments.run writes (a per-seed gap of gap -+ 0.5)."""
    path.mkdir()
    config = {"preset": {"batch_size": 4, "seq_len": 128, "steps": steps, "seeds": ",".join(map(str, seeds))},
              "arms": [{"label": label, "kind": kind, "options": opts} for label, kind, opts, _, _ in arms]}
    has_adamw = any(kind == "adamw" for _, kind, _, _, _ in arms)
    summary = {"reference": "adamw" if has_adamw else None, "arms": {}}
    for label, _, _, gap, ratio in arms:
        per_seed = {str(s): {"final_val_loss": 5.0 * (1 + (gap + (0.5 if i else -0.5) * (len(seeds) > 1)) / 100)}
                    for i, s in enumerate(seeds)}
        summary["arms"][label] = {
            "seeds": list(seeds), "final_val_loss_mean": 5.0 * (1 + gap / 100), "per_seed": per_seed,
            "gap_vs_adamw_pct_mean": gap if has_adamw else None,
            "gap_vs_adamw_pct_per_seed": [gap - 0.5, gap + 0.5] if has_adamw else [],
            "compression_vs_dense_bf16": ratio}
    (path / "config.json").write_text(json.dumps(config))
    (path / "summary.json").write_text(json.dumps(summary))


def test_frontier_table_groups_arms_by_mode(tmp_path):
    write_run(tmp_path / "sweep", [
        ("adamw", "adamw", {}, 0.0, 0.5),
        ("distro", "distro", {}, 17.0, 920.0),
        ("distro:sync_every=8", "distro", {"sync_every": 8}, 9.0, 4400.0),
        ("demo", "demo", {}, 12.0, 48.0),
    ])
    assert frontier.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "frontier.md").read_text()
    assert "| sweep | `distro:sync_every=8` | distro local steps | 512 | 300 | 2 | 5.450 | +9.0% (+8.5%, +9.5%) | - | 4,400x |" in text
    assert "| distro per step |" in text and "| demo |" in text and "0.5x" in text
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 0


def test_frontier_refuses_to_overwrite_and_rejects_unfinished_runs(tmp_path, capsys):
    write_run(tmp_path / "sweep", [("adamw", "adamw", {}, 0.0, 0.5)])
    out = tmp_path / "out"
    assert frontier.main([str(tmp_path / "sweep"), "--out", str(out)]) == 0
    before = (out / "frontier.md").read_text()
    assert frontier.main([str(tmp_path / "sweep"), "--out", str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert (out / "frontier.md").read_text() == before
    (tmp_path / "empty").mkdir()
    assert frontier.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out2")]) == 2
    assert "not a finished run directory" in capsys.readouterr().err


def test_gap_against_tokens_per_worker_step_follows_each_arm_across_runs(tmp_path):
    for batch, gap in ((4, 17.0), (32, 6.0)):
        write_run(tmp_path / f"b{batch}", [("adamw", "adamw", {}, 0.0, 0.5), ("distro", "distro", {}, gap, 920.0)])
        config = json.loads((tmp_path / f"b{batch}" / "config.json").read_text())
        config["preset"]["batch_size"] = batch
        (tmp_path / f"b{batch}" / "config.json").write_text(json.dumps(config))
    points = [p for b in (32, 4) for p in frontier.load_points(tmp_path / f"b{b}")]
    assert frontier.tokens_series(points) == {"distro": [(512, 17.0), (4096, 6.0)]}
    assert frontier.main([str(tmp_path / "b4"), str(tmp_path / "b32"), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 0


def test_run_without_adamw_is_paired_with_the_adamw_of_a_run_with_the_same_settings(tmp_path):
    write_run(tmp_path / "base", [("adamw", "adamw", {}, 0.0, 0.5), ("distro", "distro", {}, 20.0, 920.0)])
    write_run(tmp_path / "extra", [("distro:lr=0.0003", "distro", {}, 10.0, 920.0)], seeds=(0,))
    write_run(tmp_path / "longer", [("distro:lr=0.002", "distro", {}, 10.0, 920.0)], seeds=(0,), steps=3000)
    points = frontier.pair_with_adamw(
        [p for run in ("base", "extra", "longer") for p in frontier.load_points(tmp_path / run)])
    by_arm = {p["arm"]: p for p in points}
    # seed 0: 5.0 * 1.10 (extra's loss) against AdamW's 5.0 * 0.995
    assert by_arm["distro:lr=0.0003"]["gap_per_seed"] == [pytest.approx(100 * (1.10 / 0.995 - 1))]
    assert by_arm["distro:lr=0.002"]["gap_pct"] is None  # 3000 steps: no AdamW trained like it
    assert frontier.main([str(tmp_path / r) for r in ("base", "extra", "longer")] + ["--out", str(tmp_path / "out")]) == 0
    assert "no AdamW run with these settings" in (tmp_path / "out" / "frontier.md").read_text()


def test_table_numbers_the_plotted_points_and_leaves_adamw_unnumbered(tmp_path):
    arms = [("adamw", "adamw", {}, 0.0, 0.5)] + [
        (f"distro:topk={k}", "distro", {"compression_topk": k}, 10.0 + k, 4096.0 / k) for k in range(1, 11)
    ]
    write_run(tmp_path / "many", arms)
    assert frontier.main([str(tmp_path / "many"), "--out", str(tmp_path / "out")]) == 0
    rows = (tmp_path / "out" / "frontier.md").read_text().splitlines()[2:]
    numbers = [line.split("|")[1].strip() for line in rows]
    assert numbers[0] == "" and "`adamw`" in rows[0]
    assert numbers[1:] == [str(n) for n in range(1, 11)]
    assert "`distro:topk=1`" in rows[1]  # numbered in table order: most compressed first


def test_runs_saved_before_the_sharding_field_pair_with_contiguous_runs_only(tmp_path):
    write_run(tmp_path / "old", [("adamw", "adamw", {}, 0.0, 0.5)], seeds=(0,))  # config without "sharding"
    for name, sharding in (("new", "contiguous"), ("iid", "iid")):
        write_run(tmp_path / name, [(f"distro:{name}", "distro", {}, 10.0, 920.0)], seeds=(0,))
        config = json.loads((tmp_path / name / "config.json").read_text())
        config["preset"]["sharding"] = sharding
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    points = frontier.pair_with_adamw([p for run in ("old", "new", "iid") for p in frontier.load_points(tmp_path / run)])
    by_arm = {p["arm"]: p for p in points}
    assert by_arm["distro:new"]["gap_pct"] == pytest.approx(100 * (1.10 / 1.0 - 1))
    assert by_arm["distro:iid"]["gap_pct"] is None


def test_arm_that_sent_nothing_is_listed_without_a_compression_and_not_plotted(tmp_path):
    write_run(tmp_path / "local", [
        ("adamw", "adamw", {}, 0.0, 0.5),
        ("distro", "distro", {}, 17.0, 920.0),
        ("distro:sync_every=100", "distro", {"sync_every": 100}, 3.0, None),  # never synced in 6 steps
    ])
    assert frontier.main([str(tmp_path / "local"), "--out", str(tmp_path / "out")]) == 0
    rows = (tmp_path / "out" / "frontier.md").read_text().splitlines()[2:]
    silent = next(line for line in rows if "`distro:sync_every=100`" in line)
    assert silent.split("|")[1].strip() == "" and silent.endswith("| nothing sent |")
    assert "| 1 | local | `distro` |" in "\n".join(rows)
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 0


def test_unusable_out_folder_is_a_one_line_error(tmp_path, capsys):
    write_run(tmp_path / "sweep", [("adamw", "adamw", {}, 0.0, 0.5)])
    (tmp_path / "file").write_text("in the way")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        assert frontier.main([str(tmp_path / "sweep"), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: cannot use {tmp_path / 'file'}") and len(err.splitlines()) == 1
    assert (tmp_path / "file").read_text() == "in the way"
