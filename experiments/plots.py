"""The run's PNG plots: val loss vs step, val loss vs cumulative bytes, bytes per step, time to loss.

Time to loss is a projection, not a measurement of a real network. Its model, also written on the
plot: per step, compute time as measured in this run (forward, backward, optimizer and codec, per
worker) plus communication time = rounds x latency + bytes sent per worker / link bandwidth, with no
overlap of compute and communication. A ring all-reduce takes 2(N-1) sequential rounds; the
all-gather of compressed payloads sends to all peers at once (1 round) through the same uplink.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

from .metrics import job_rows  # noqa: E402

LINKS_BPS = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9}
LATENCY_S = 0.05


def comm_seconds(
    kind: str, sent_bytes_per_step: float, world_size: int, link_bps: float, latency_s: float = LATENCY_S
) -> float:
    if kind == "alone":  # no network
        return 0.0
    rounds = 2 * (world_size - 1) if kind in ("adamw", "powersgd") else 1  # ring all-reduces
    return rounds * latency_s + 8.0 * sent_bytes_per_step / link_bps


def steps_to_loss(rows: list[dict], target: float) -> int | None:
    """First evaluated step whose validation loss is at or below ``target`` (None: never reached)."""
    for r in rows:
        if r["val_loss"] is not None and r["step"] > 0 and r["val_loss"] <= target:
            return r["step"]
    return None


def time_to_loss(summary: dict, rows: list[dict], config: dict) -> dict:
    """{arm: {link: (seconds, reached)}} to the reference AdamW arm's final validation loss (first seed).

    An arm that never reached it gets the projected time of all its steps and ``reached=False``."""
    ref = summary["reference"]
    if ref is None or ref not in summary["arms"]:
        return {}
    seed = summary["arms"][ref]["seeds"][0]
    target = summary["arms"][ref]["per_seed"][str(seed)]["final_val_loss"]
    out = {}
    for label, arm in summary["arms"].items():
        if str(seed) not in arm["per_seed"]:
            continue
        job = arm["per_seed"][str(seed)]
        steps = steps_to_loss(job_rows(rows, label, seed), target)
        reached = steps is not None
        steps = steps if reached else job["steps"]
        out[label] = {
            link: (
                steps
                * (
                    job["compute_s_per_step"]
                    + comm_seconds(arm["kind"], job["sent_bytes_per_step"], config["workers"], bps)
                ),
                reached,
            )
            for link, bps in LINKS_BPS.items()
        }
    return out


def _val_series(rows, label, seed):
    pts = [r for r in job_rows(rows, label, seed) if r["val_loss"] is not None]
    return pts


def make_plots(out: Path, config: dict, rows: list[dict], summary: dict) -> list[Path]:
    out = Path(out)
    paths = []
    labels = list(summary["arms"])

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in labels:
        for i, seed in enumerate(summary["arms"][label]["seeds"]):
            pts = _val_series(rows, label, seed)
            ax.plot(
                [r["step"] for r in pts],
                [r["val_loss"] for r in pts],
                marker=".",
                label=label if i == 0 else None,
                color=f"C{labels.index(label)}",
                alpha=1.0 if i == 0 else 0.5,
            )
    ax.set(xlabel="step", ylabel="validation loss (nats/token)", title="Validation loss vs step")
    ax.legend(), ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "val_loss_vs_step.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in labels:
        seed = summary["arms"][label]["seeds"][0]
        pts = [r for r in _val_series(rows, label, seed) if r["cum_sent_bytes"] > 0]
        ax.plot([r["cum_sent_bytes"] for r in pts], [r["val_loss"] for r in pts], marker=".", label=label)
    ax.set_xscale("log")
    ax.set(
        xlabel="cumulative bytes sent per worker",
        ylabel="validation loss",
        title="Validation loss vs traffic",
    )
    ax.legend(), ax.grid(alpha=0.3, which="both")
    paths.append(_save(fig, out / "val_loss_vs_bytes.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sent = [summary["arms"][a]["sent_bytes_per_step"] for a in labels]
    bars = ax.bar(labels, sent, color=[f"C{i}" for i in range(len(labels))])
    for bar, value, a in zip(bars, sent, labels):
        ratio = summary["arms"][a]["compression_vs_dense_bf16"]
        ax.annotate(
            f"{value:,.0f} B\n{ratio:.3g}x vs bf16" if ratio else f"{value:,.0f} B",
            (bar.get_x() + bar.get_width() / 2, value),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_yscale("log")
    ax.set_ylim(top=max(sent) * 5)  # room for the labels
    ax.set(ylabel="bytes sent per worker per step", title=f"Traffic per step ({config['workers']} workers)")
    paths.append(_save(fig, out / "bytes_per_step.png"))

    times = time_to_loss(summary, rows, config)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    width = 0.8 / max(1, len(LINKS_BPS))
    for j, link in enumerate(LINKS_BPS):
        xs = [i + j * width for i in range(len(times))]
        vals = [times[a][link] for a in times]
        ax.bar(
            xs,
            [v for v, _ in vals],
            width=width,
            label=link,
            color=f"C{j}",
            hatch=["" if ok else "//" for _, ok in vals],
            edgecolor="white",
        )
        for x, (v, ok) in zip(xs, vals):
            ax.annotate(
                f"{v:,.0f} s" if ok else f"not reached\n(> {v:,.0f} s)",
                (x, v),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks([i + width * (len(LINKS_BPS) - 1) / 2 for i in range(len(times))], list(times))
    ax.set_yscale("log")
    all_s = [v for a in times for v, _ in times[a].values()]
    if all_s:
        ax.set_ylim(min(all_s) / 4, max(all_s) * 4)  # bars visibly start below the smallest value
    ax.set(
        ylabel="projected seconds",
        title=f"Projected time to AdamW's final val loss ({config['workers']} workers)",
    )
    ax.legend(loc="upper right")
    fig.text(
        0.01,
        0.01,
        f"Model: steps to target x (measured compute/step + rounds x {LATENCY_S * 1e3:.0f} ms latency "
        "+ bytes sent per worker / link).\nRing all-reduce: 2(N-1) rounds; all-gather: 1 round; no overlap; "
        "compute as measured on this machine.",
        fontsize=7,
    )
    fig.subplots_adjust(bottom=0.2)
    paths.append(_save(fig, out / "time_to_loss.png"))
    paths.append(_save(retained_gain_figure(summary), out / "retained_gain_vs_bytes.png"))
    return paths


def retained_gain_figure(summary: dict):
    """R (``experiments.gains``) of every arm that sends bytes against its bytes per worker-step (log
    x), each seed a small point and the mean a large one; 100% (data-parallel AdamW's gain) and 0%
    (one worker alone) drawn as lines."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shown = [(label, a) for label, a in summary["arms"].items()
             if a.get("retained_gain_pct_per_seed") and a["sent_bytes_per_step"] > 0]
    for i, (label, a) in enumerate(shown):
        x = a["sent_bytes_per_step"]
        seeds = [r for r in a["retained_gain_pct_per_seed"] if r is not None]
        ax.scatter([x] * len(seeds), seeds, color=f"C{i}", s=12, alpha=0.6)
        if a["retained_gain_pct_mean"] is not None:
            ax.scatter([x], [a["retained_gain_pct_mean"]], color=f"C{i}", s=50, label=label)
    ax.axhline(100.0, color="grey", linestyle="--", linewidth=0.8, label="data-parallel AdamW (100%)")
    ax.axhline(0.0, color="black", linestyle=":", linewidth=0.8, label="one worker alone (0%)")
    ax.set_xscale("log")
    title = "Retained gain vs traffic"
    if not shown:
        title += " (no R: the run has no alone or no data-parallel AdamW arm)"
    ax.set(xlabel="bytes sent per worker per step (log)", ylabel="R: retained data-parallel gain (%)", title=title)
    ax.legend(fontsize=7), ax.grid(alpha=0.3, which="both")
    return fig


PLOT_FILES = ("val_loss_vs_step.png", "val_loss_vs_bytes.png", "bytes_per_step.png", "time_to_loss.png",
              "retained_gain_vs_bytes.png")


def run_plots(out: Path, config: dict, rows: list[dict], summary: dict) -> list[Path]:
    """The run's plots: the saved PNGs when all are there, else freshly made ones."""
    paths = [Path(out) / name for name in PLOT_FILES]
    return paths if all(p.exists() for p in paths) else make_plots(out, config, rows, summary)


def _save(fig, path: Path) -> Path:
    fig.tight_layout(rect=(0, 0.06, 1, 1)) if path.name == "time_to_loss.png" else fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
