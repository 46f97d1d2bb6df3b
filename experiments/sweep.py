"""Tuned comparisons: every arm at every point of the same learning-rate grid, best against best.

``--sweep "lr=0.5x,1x,2x,4x"`` runs each arm of ``--arms`` once per value; ``2x`` is twice the arm's
own lr (its ``lr=`` option, else the preset's), a plain number is the lr itself. Per-kind lrs
(``embed.lr=...``) move with it, so their ratio to the main lr is kept. A second key,
``"lr=1x,2x;outer_lr=0.7,1"``, adds the outer step's lr for arms with local steps (``sync_every > 1``):
those arms run the product of both grids, every other arm the lr grid alone.

Why one grid for all: an untuned baseline makes any method look good (the DeMo paper's reviewers
objected to exactly that), and a grid that is wider for one arm tilts the comparison its way. Each arm
is then represented by the one grid point with the lowest mean final validation loss over the seeds,
one setting for all seeds as a user would pick it, and its gap is paired per seed against AdamW's
chosen point. ``tuned`` in summary.json says which point won, the gap per seed, and whether the winner
sits on the edge of the grid (the grid should then be widened).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import statistics

from .arms import Arm, check_distinct_files, option_default
from .gains import mean_or_none, per_seed_pct, retained_gains

SWEEP_KEYS = ("lr", "outer_lr")
_POINT = re.compile(r"^(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?x?$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class GridValue:
    text: str  # as typed: "2x" or "0.003"
    value: float
    relative: bool  # a multiple of the arm's own value

    def apply(self, base: float) -> float:
        return base * self.value if self.relative else self.value


def parse_sweep(text: str) -> dict[str, list[GridValue]]:
    """``"lr=0.5x,1x,2x;outer_lr=0.7,1"`` -> {"lr": [...], "outer_lr": [...]}; "" -> {} (no sweep)."""
    grid: dict[str, list[GridValue]] = {}
    for part in filter(None, (p.strip() for p in re.split(r"[;\s]+", text.strip()))):
        key, eq, values = part.partition("=")
        if not eq:
            raise ValueError(f"Invalid sweep {text!r}: {part!r} is not key=v1,v2,...")
        if key not in SWEEP_KEYS:
            raise ValueError(f"Invalid sweep {text!r}: unknown key {key!r} (expected {' or '.join(SWEEP_KEYS)})")
        if key in grid:
            raise ValueError(f"Invalid sweep {text!r}: {key!r} is given twice")
        points = []
        for item in values.split(","):
            item = item.strip()
            if not _POINT.match(item) or float(item.rstrip("xX")) <= 0:
                raise ValueError(
                    f"Invalid sweep {text!r}: {item!r} is not a positive number or multiple (e.g. 0.002 or 2x)"
                )
            points.append(GridValue(item, float(item.rstrip("xX")), item[-1] in "xX"))
        if len({p.text for p in points}) != len(points):
            raise ValueError(f"Invalid sweep {text!r}: a value of {key!r} is listed twice")
        grid[key] = points
    return grid


def has_outer_step(arm: Arm) -> bool:
    return arm.kind in ("distro", "diloco") and int(arm.options.get("sync_every", option_default(arm, "sync_every"))) > 1


def _point_options(arm: Arm, point: dict[str, GridValue], preset_lr: float) -> dict:
    options = dict(arm.options)
    if "lr" in point:
        base = float(options.get("lr", preset_lr))
        new = point["lr"].apply(base)
        options["lr"] = new
        for key in [k for k in options if k.endswith(".lr")]:
            options[key] = options[key] * new / base
    if "outer_lr" in point:
        options["outer_lr"] = point["outer_lr"].apply(float(options.get("outer_lr", option_default(arm, "outer_lr"))))
    return options


def expand(arms: list[Arm], grid: dict[str, list[GridValue]], preset_lr: float) -> list[Arm]:
    """Each arm once per grid point, labelled ``ARM@lr=2x``; the arms as they are when there is no grid."""
    if not grid:
        return list(arms)
    out = []
    for arm in arms:
        keys = [k for k in grid if k != "outer_lr" or has_outer_step(arm)]
        for values in itertools.product(*(grid[k] for k in keys)):
            point = dict(zip(keys, values))
            label = arm.label + "@" + ",".join(f"{k}={v.text}" for k, v in point.items())
            out.append(Arm(
                label=label, kind=arm.kind, options=_point_options(arm, point, preset_lr),
                base=arm.label, point={k: v.text for k, v in point.items()},
            ))
    check_distinct_files(out)  # "1x" and "1X" would share result files
    return out


def tuned_summary(config_arms: list[dict], arms_summary: dict, seeds: list[int]) -> dict | None:
    """Per base arm: the grid point with the lowest mean final val loss over ``seeds`` (points that did
    not finish every seed are not candidates), and its gap per seed against AdamW's chosen point.
    None when the run has no sweep."""
    bases: dict[str, list[dict]] = {}
    for arm in config_arms:
        if arm.get("base"):
            bases.setdefault(arm["base"], []).append(arm)
    if not bases:
        return None
    chosen = {}
    for base, points in bases.items():
        done = [a for a in points if a["label"] in arms_summary
                and set(arms_summary[a["label"]]["seeds"]) == set(seeds)]
        if done:
            best = min(done, key=lambda a: arms_summary[a["label"]]["final_val_loss_mean"])
            chosen[base] = (best, points)
    ref = next((b for b, (a, _) in chosen.items() if a["kind"] == "adamw"), None)
    alone = next((b for b, (a, _) in chosen.items() if a["kind"] == "alone"), None)

    def best_losses(base):
        per_seed = arms_summary[chosen[base][0]["label"]]["per_seed"]
        return {str(s): per_seed[str(s)]["final_val_loss"] for s in seeds}

    alone_losses = best_losses(alone) if alone is not None else None
    ref_losses_r = best_losses(ref) if ref is not None else None
    out = {"reference": ref, "alone": alone,
           "rule": "lowest mean final val loss over seeds; gap paired per seed", "arms": {}}
    for base, (best, points) in chosen.items():
        result = arms_summary[best["label"]]
        losses = {str(s): result["per_seed"][str(s)]["final_val_loss"] for s in seeds}
        gaps = None
        if ref is not None:
            ref_losses = arms_summary[chosen[ref][0]["label"]]["per_seed"]
            gaps = [100.0 * (losses[str(s)] / ref_losses[str(s)]["final_val_loss"] - 1) for s in seeds]
        out["arms"][base] = {
            "kind": best["kind"],
            "point": best["point"],
            "label": best["label"],
            "points_run": len(points),
            "final_val_loss_per_seed": losses,
            "final_val_loss_mean": result["final_val_loss_mean"],
            "gap_vs_tuned_adamw_pct_per_seed": gaps,
            "gap_vs_tuned_adamw_pct_mean": statistics.fmean(gaps) if gaps else None,
            # R against the tuned alone baseline and the tuned data-parallel AdamW (metrics.retained_gain_pct)
            "retained_gain_pct_per_seed": (gains := retained_gains(losses, alone_losses, ref_losses_r)),
            "retained_gain_pct_mean": mean_or_none(gains),
            "at_grid_edge": _edge_keys(best, points),
            "compression_vs_dense_bf16": result["compression_vs_dense_bf16"],
            "sent_bytes_per_step": result["sent_bytes_per_step"],
        }
    return out


def _edge_keys(best: dict, points: list[dict]) -> list[str]:
    """The swept keys whose chosen value is the grid's first or last (in the order given)."""
    edge = []
    for key, value in best["point"].items():
        grid = list(dict.fromkeys(p["point"][key] for p in points))
        if len(grid) > 1 and value in (grid[0], grid[-1]):
            edge.append(key)
    return edge


def tuned_table(tuned: dict) -> str:
    """Markdown: one row per base arm, its chosen point and the best-vs-best gap per seed."""
    ref = (f"reference: `{tuned['reference']}`" if tuned["reference"] else
           "no AdamW arm here: experiments.frontier pairs these with the tuned AdamW of another run")
    lines = [
        f"Tuned, best vs best ({tuned['rule']}; {ref}):",
        "",
        "| arm | chosen point | grid points | final val loss (per seed) | gap vs tuned AdamW (per seed) | "
        "R vs tuned alone (per seed) | vs dense bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for base, a in tuned["arms"].items():
        point = ", ".join(f"{k}={v}" for k, v in a["point"].items())
        if a["at_grid_edge"]:
            point += f" (edge of the grid in {', '.join(a['at_grid_edge'])})"
        losses = ", ".join(f"{v:.3f}" for v in a["final_val_loss_per_seed"].values())
        if a["gap_vs_tuned_adamw_pct_mean"] is None or base == tuned["reference"]:
            gap = "-"
        else:
            gap = f"{a['gap_vs_tuned_adamw_pct_mean']:+.2f}% (" + ", ".join(
                f"{g:+.2f}%" for g in a["gap_vs_tuned_adamw_pct_per_seed"]) + ")"
        ratio = a["compression_vs_dense_bf16"]
        gain = per_seed_pct(a.get("retained_gain_pct_mean"), a.get("retained_gain_pct_per_seed") or [], ".0f")
        lines.append(f"| {base} | {point} | {a['points_run']} | {losses} | {gap} | {gain} | "
                     f"{'-' if ratio is None else format(ratio, '.1f') + 'x'} |")
    return "\n".join(lines) + "\n"
