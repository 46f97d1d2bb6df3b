"""The loss-vs-traffic frontier across runs: gap to AdamW (y) against compression vs bf16 (x, log).

Reads the ``summary.json`` and ``config.json`` of one or more run directories written by
``python -m experiments.run`` and writes ``frontier.md`` (a table) and ``frontier.png`` into
``--out``. Each arm is one point: its mean final validation-loss gap to the run's AdamW arm (paired
per seed) against what one worker sends per step relative to a dense bf16 gradient. A run without
an AdamW arm is paired with the AdamW arm of another run given that trained with the same settings. Arms are
grouped by mode: per-step DisTrO, local steps (``sync_every > 1``), DeMo. Where a run has the alone
baseline, each arm's retained gain R (``experiments.gains``) is in the table and a panel of its own. A ``--sweep`` run gives one
point per arm, at its best grid point, with its gap to the best AdamW point (of that run, or of another
sweep run with the same settings). When the runs differ in
tokens per worker-step (``--batch-size``, ``--seq-len``), a second panel draws each arm's gap against
it.

    python -m experiments.frontier runs/sweep-a runs/sweep-b --out runs/frontier
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from distro_opt.cli_args import fail, os_error_message

from .gains import mean_or_none, per_seed_pct, retained_gains
from .presets import saved_preset_fields


def mode_of(arm: dict) -> str:
    if arm["kind"] != "distro":
        return arm["kind"]
    return "distro local steps" if int(arm["options"].get("sync_every", 1)) > 1 else "distro per step"


# Preset fields that do not change what an arm learns: runs that differ only in these share an AdamW.
# The grid is not one either: a sweep's tuned points pair with the tuned AdamW of another sweep run.
_NOT_TRAINING = {"name", "arms", "seeds", "sweep", "eval_every", "checkpoint_every", "torch_threads", "timeout_s"}


def load_points(run_dir: Path) -> list[dict]:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{run_dir} is not a finished run directory ({exc})") from None
    preset = saved_preset_fields(config["preset"])
    tokens_per_worker_step = preset["batch_size"] * preset["seq_len"]
    setting = json.dumps({k: v for k, v in preset.items() if k not in _NOT_TRAINING}, sort_keys=True)
    arms = {a["label"]: a for a in config["arms"]}
    if summary.get("tuned"):
        return _tuned_points(run_dir, summary, config, arms, setting, preset, tokens_per_worker_step)
    points = []
    for label, result in summary["arms"].items():
        points.append(dict(
            run=run_dir.name, arm=label, mode=mode_of(arms[label]), seeds=len(result["seeds"]),
            steps=preset["steps"], tokens_per_worker_step=tokens_per_worker_step,
            val_loss=result["final_val_loss_mean"], gap_pct=result["gap_vs_adamw_pct_mean"],
            gap_per_seed=result["gap_vs_adamw_pct_per_seed"], compression=result["compression_vs_dense_bf16"],
            setting=setting, reference=summary.get("reference"), alone=summary.get("alone"),
            loss_per_seed={s: v["final_val_loss"] for s, v in result["per_seed"].items()},
            r_pct=result.get("retained_gain_pct_mean"), r_per_seed=result.get("retained_gain_pct_per_seed") or [],
        ))
    return points


def _tuned_points(run_dir, summary, config, arms, setting, preset, tokens_per_worker_step) -> list[dict]:
    """A sweep's run: one point per arm as typed, at its chosen grid point, with the best-vs-best gap."""
    tuned = summary["tuned"]
    points = []
    for base, t in tuned["arms"].items():
        label = f"{base} (tuned: {', '.join(f'{k}={v}' for k, v in t['point'].items())})"
        points.append(dict(
            run=run_dir.name, arm=label, mode=mode_of(arms[t["label"]]), seeds=len(config["seeds"]),
            steps=preset["steps"], tokens_per_worker_step=tokens_per_worker_step,
            val_loss=t["final_val_loss_mean"], gap_pct=None if base == tuned["reference"] else t["gap_vs_tuned_adamw_pct_mean"],
            gap_per_seed=t["gap_vs_tuned_adamw_pct_per_seed"] or [], compression=t["compression_vs_dense_bf16"],
            setting=setting, reference=label if base == tuned["reference"] else None,
            alone=label if base == tuned.get("alone") else None,
            loss_per_seed=t["final_val_loss_per_seed"], tuned=True,
            r_pct=t.get("retained_gain_pct_mean"), r_per_seed=t.get("retained_gain_pct_per_seed") or [],
        ))
    return points


def pair_with_adamw(points: list[dict]) -> list[dict]:
    """Give arms of runs without an AdamW arm the gap to an AdamW arm of another run given, trained
    with the same settings and seeds (runs are deterministic per seed, so AdamW need not run twice),
    and their R against that run's alone baseline. Arms with no such AdamW keep ``gap_pct`` None."""
    adamw: dict[tuple[str, bool], dict[str, float]] = {}  # tuned points pair only with a tuned AdamW
    for p in points:
        if p["mode"] == "adamw" and p["arm"] == p["reference"]:
            adamw.setdefault((p["setting"], p.get("tuned", False)), {}).update(p["loss_per_seed"])
    alone: dict[tuple[str, bool], dict[str, float]] = {}
    for p in points:
        if p["mode"] == "alone" and p["arm"] == p.get("alone"):
            alone.setdefault((p["setting"], p.get("tuned", False)), {}).update(p["loss_per_seed"])
    for p in points:
        key = (p["setting"], p.get("tuned", False))
        ref = adamw.get(key, {})
        if p["gap_pct"] is None:
            gaps = [100.0 * (loss / ref[s] - 1) for s, loss in p["loss_per_seed"].items() if s in ref]
            if gaps:
                p["gap_per_seed"], p["gap_pct"] = gaps, sum(gaps) / len(gaps)
        if p.get("r_pct") is None and not p.get("r_per_seed") and key in alone and ref:
            p["r_per_seed"] = retained_gains(p["loss_per_seed"], alone[key], ref)
            p["r_pct"] = mean_or_none(p["r_per_seed"])
    return points


def _ratio(x: float | None) -> str:
    if x is None:  # an arm that never synchronized within its steps (sync_every > steps)
        return "nothing sent"
    return f"{x:,.0f}x" if x >= 10 else f"{x:.2g}x"


MAX_NAMED_POINTS = 8  # beyond this many points the plot numbers them instead of naming them


def numbered(points: list[dict]) -> list[tuple[int | None, dict]]:
    """The points in table order, each with its number on the plot: 1, 2, ... for the points that
    have a gap and a compression to plot (AdamW arms, unpaired arms and arms that sent nothing get
    None: a log axis has no place for them)."""
    ordered = sorted(points, key=lambda p: (p["run"], p["mode"], -(p["compression"] or 0.0)))
    count, out = 0, []
    for p in ordered:
        plotted = p["mode"] != "adamw" and p["gap_pct"] is not None and p["compression"] is not None
        count += plotted
        out.append((count if plotted else None, p))
    return out


def table(points: list[dict]) -> str:
    lines = ["| # | run | arm | mode | tokens/worker-step | steps | seeds | val loss | gap vs AdamW (per seed) | "
             "R, retained gain (per seed) | vs dense bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for number, p in numbered(points):
        per_seed = ", ".join(f"{g:+.1f}%" for g in p["gap_per_seed"])
        gap = "no AdamW run with these settings" if p["gap_pct"] is None else f"{p['gap_pct']:+.1f}% ({per_seed})"
        gain = per_seed_pct(p.get("r_pct"), p.get("r_per_seed") or [], ".0f")
        lines.append(f"| {number or ''} | {p['run']} | `{p['arm']}` | {p['mode']} | {p['tokens_per_worker_step']} | "
                     f"{p['steps']} | {p['seeds']} | {p['val_loss']:.3f} | {gap} | {gain} | {_ratio(p['compression'])} |")
    return "\n".join(lines) + "\n"


def tokens_series(points: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Per arm label, its (tokens per worker-step, gap %) points sorted by tokens: how the gap moves
    when each worker sees more tokens per step (only arms measured at two or more such values)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for p in points:
        if p["mode"] != "adamw" and p["gap_pct"] is not None:
            series.setdefault(p["arm"], []).append((p["tokens_per_worker_step"], p["gap_pct"]))
    return {arm: sorted(pts) for arm, pts in series.items() if len({t for t, _ in pts}) > 1}


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = tokens_series(points)
    shown = [(n, p) for n, p in numbered(points) if n is not None]
    with_r = [(n, p) for n, p in shown if p.get("r_pct") is not None]
    panels = 1 + bool(series) + bool(with_r)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels if panels > 1 else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    several_runs = len({p["run"] for p in points}) > 1
    by_number = len(shown) > MAX_NAMED_POINTS  # names would overlap: numbers, explained by frontier.md
    modes = sorted({p["mode"] for _, p in shown})
    colors = {mode: f"C{i}" for i, mode in enumerate(modes)}  # one colour per mode, in both panels
    for mode in modes:
        pts = [(n, p) for n, p in shown if p["mode"] == mode]
        ax.scatter([p["compression"] for _, p in pts], [p["gap_pct"] for _, p in pts], label=mode, color=colors[mode])
        for n, p in pts:
            if by_number:
                text = str(n)
            else:  # one arm, several runs: tell them apart
                text = f"{p['arm']} [{p['run']}]" if several_runs else p["arm"]
            ax.annotate(text, (p["compression"], p["gap_pct"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8, label="1% gap target")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per worker per step: dense bf16 gradient / arm (x, log)")
    ax.set_ylabel("final val loss gap vs AdamW (%)")
    ax.set_title("Loss vs traffic frontier" + (" (point numbers: rows of frontier.md)" if by_number else ""))
    ax.legend(fontsize=7)
    if series:
        ax = axes[0][1]
        mode_of_arm = {p["arm"]: p["mode"] for p in points}
        styles = ("-", "--", ":", "-.")
        for i, (arm, pts) in enumerate(series.items()):
            ax.plot([t for t, _ in pts], [g for _, g in pts], marker="o", label=arm,
                    color=colors[mode_of_arm[arm]], linestyle=styles[i % len(styles)])
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per worker-step (log)")
        ax.set_ylabel("final val loss gap vs AdamW (%)")
        ax.set_title("Gap vs tokens per worker-step")
        ax.legend(fontsize=7)
    if with_r:
        ax = axes[0][panels - 1]
        for mode in modes:
            pts = [(n, p) for n, p in with_r if p["mode"] == mode]
            ax.scatter([p["compression"] for _, p in pts], [p["r_pct"] for _, p in pts], label=mode, color=colors[mode])
            for n, p in pts:
                ax.annotate(str(n), (p["compression"], p["r_pct"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.axhline(100.0, color="grey", linestyle="--", linewidth=0.8, label="data-parallel AdamW")
        ax.axhline(0.0, color="black", linestyle=":", linewidth=0.8, label="one worker alone")
        ax.set_xscale("log")
        ax.set_xlabel("dense bf16 gradient / bytes per worker-step (x, log)")
        ax.set_ylabel("R: retained data-parallel gain (%)")
        ax.set_title("Retained gain vs traffic (point numbers: rows of frontier.md)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.frontier", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories of experiments.run")
    parser.add_argument("--out", type=Path, required=True, help="folder for frontier.md and frontier.png")
    parser.add_argument("--force", action="store_true", help="replace an existing frontier.md/.png in --out")
    args = parser.parse_args(argv)
    if not args.force and any((args.out / f).exists() for f in ("frontier.md", "frontier.png")):
        return fail(f"{args.out} already holds a frontier; pass --force to replace it")
    try:
        points = pair_with_adamw([p for run in args.runs for p in load_points(run)])
    except ValueError as exc:
        return fail(str(exc))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "frontier.md").write_text(table(points))
        plot(points, args.out / "frontier.png")
    except OSError as exc:
        return fail(os_error_message(exc))
    print(table(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
