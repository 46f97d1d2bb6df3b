"""experiments.frontier turns run summaries into a gap-vs-compression table and plot."""
import json

from distro_opt.experiments import frontier


def write_run(path, arms):
    """A finished run directory with the fields experiments.run writes (two seeds per arm)."""
    path.mkdir()
    config = {"preset": {"batch_size": 4, "seq_len": 128, "steps": 300},
              "arms": [{"label": label, "kind": kind, "options": opts} for label, kind, opts, _, _ in arms]}
    summary = {"arms": {label: {"seeds": [0, 1], "final_val_loss_mean": 5.0 * (1 + gap / 100),
                                "gap_vs_adamw_pct_mean": gap, "gap_vs_adamw_pct_per_seed": [gap - 0.5, gap + 0.5],
                                "compression_vs_dense_bf16": ratio}
                        for label, _, _, gap, ratio in arms}}
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
    assert "| sweep | `distro:sync_every=8` | distro local steps | 512 | 300 | 2 | 5.450 | +9.0% (+8.5%, +9.5%) | 4,400x |" in text
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
