"""The runner's summary of a run that has not finished (or was stopped): its jobs done so far.

    python research/partial_summary.py RUN_DIR [RUN_DIR ...]

Prints, per run directory, the tuned table (``experiments.sweep.tuned_table``; a grid point is a
candidate once every seed of it finished) or, for a run with no sweep, the summary table; writes
nothing. A long study's finished points have their own summary.md: this is for the one under way.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments.metrics import load_run, markdown_table, summarize  # noqa: E402
from experiments.sweep import tuned_table  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    for run_dir in argv:
        config, rows, results = load_run(run_dir)
        done = sum(r["status"] == "done" for r in results.values())
        total = len(config["arms"]) * len(config["seeds"])
        print(f"## {run_dir}: {done} of {total} jobs finished\n")
        summary = summarize(config, rows, results)
        print(tuned_table(summary["tuned"]) if summary.get("tuned") else markdown_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
