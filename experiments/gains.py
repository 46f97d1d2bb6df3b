"""The measure a networked run must pass first: the retained gain R against one worker alone.

Data parallelism's gain G = L(alone) - L(data-parallel AdamW), and an arm's retained gain
R = (L(alone) - L(arm)) / G (background.md, "worth the network"). The alone arm
(``arms.ALONE``) is AdamW on one worker with the same per-worker batch and steps and no network.
"""

from __future__ import annotations

import statistics


def retained_gain_pct(loss: float, alone: float, data_parallel: float) -> float | None:
    """R = (L(alone) - L(arm)) / G, G = L(alone) - L(data-parallel AdamW), in percent
    (background.md, last section): 100% keeps all of data parallelism's gain, 0% is no better than
    one worker alone, below 0 the network made the model worse. None where G <= 0: data parallelism
    gained nothing to retain."""
    gain = alone - data_parallel
    return 100.0 * (alone - loss) / gain if gain > 0 else None


def retained_gains(losses: dict, alone: dict | None, data_parallel: dict | None) -> list[float | None]:
    """R per seed (``retained_gain_pct``) for the seeds all three losses ({seed: loss}) have."""
    if alone is None or data_parallel is None:
        return []
    return [retained_gain_pct(losses[s], alone[s], data_parallel[s]) for s in losses
            if s in alone and s in data_parallel]


def mean_or_none(values: list[float | None]) -> float | None:
    """The mean, or None when a value is missing (R undefined on a seed) or there are none."""
    return statistics.fmean(values) if values and None not in values else None


def per_seed_pct(mean, per_seed: list, spec: str = ".1f") -> str:
    """``+12% (+10%, +14%)``: a mean with its seeds (a difference is real only if every seed shows
    it); ``-`` where undefined, ``n/a`` for a seed whose value is undefined."""
    if not per_seed:
        return "-"
    seeds = ", ".join("n/a" if v is None else format(v, "+" + spec) + "%" for v in per_seed)
    head = "n/a" if mean is None else format(mean, "+" + spec) + "%"
    return head if len(per_seed) == 1 else f"{head} ({seeds})"


def gain_line(summary: dict) -> str:
    """The sentence that defines R for this run, with its data-parallel gain G per seed."""
    gains = summary.get("data_parallel_gain_per_seed") or {}
    if not gains:
        return ("R (retained gain): not measured here (it needs the alone arm and a data-parallel AdamW "
                "arm; the runner adds alone unless --no-alone).")
    values = ", ".join(f"{g:.3f}" for g in gains.values())
    note = " G <= 0 on a seed: data parallelism gained nothing there, so R is n/a." if min(gains.values()) <= 0 else ""
    return (f"R (retained gain) = (L(alone) - L(arm)) / G, with G = L(`{summary['alone']}`) - "
            f"L(`{summary['reference']}`) = {values} (per seed): 100% keeps data parallelism's gain, "
            f"0% is one worker alone, below 0 the network made the model worse.{note}")
