"""metrics.jsonl (one row per step) and the run summary computed from it.

Byte conventions come from ``CommStats`` only (``distro_opt.comm.base``):

* measured: what ``backend.stats`` counted, per worker (sent and received are equal in a fixed world);
* expected: the codec's payload (``opt.payload_nbytes``) through ``CommStats.all_gather_bytes``, or the
  flat fp32 gradient through ``CommStats.ring_all_reduce_bytes`` for the AdamW arm;
* compression vs a dense bf16 gradient: 2 bytes x parameters over the bytes one worker contributes
  per step (its payload times collectives per step), independent of the collective's algorithm;
* vs a ring all-reduce of the bf16 gradient (``ring_all_reduce_bytes``), on bytes sent per worker;
* vs a naive gather of the bf16 gradient (``naive_all_reduce_bytes``: the DisTrO report's
  31 x 2.4 GB), on bytes received per worker.

The replica checks (``distro_opt.guards``: an all-gather of ``CHECKSUM_NBYTES`` per worker at the
first step and after each resume) are counted apart from the per-step payload: every per-step figure
is of the payload stream, and the formula check covers both.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from distro_opt.comm import CommStats
from distro_opt.guards import CHECKSUM_NBYTES

from .files import write_atomic
from .gains import gain_line, mean_or_none, per_seed_pct, retained_gains
from .sweep import tuned_summary, tuned_table

BF16_BYTES = 2


class MetricsSink:
    """Appends rank 0's rows to metrics.jsonl (flushed each step, so a kill loses at most one row)
    and drives the progress bar."""

    def __init__(self, path: Path, arm: str, seed: int, steps: int, start_step: int, progress: bool = True):
        self.arm, self.seed = arm, seed
        self._file = open(path, "a", encoding="utf-8")
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=steps,
                initial=start_step,
                desc=f"{arm} seed {seed}",
                unit="step",
                dynamic_ncols=True,
                leave=True,
            )

    def row(self, *, step, train_loss, val_loss, lr, tokens, sent, received, state, times) -> None:
        compute_s, codec_s, comm_s, eval_s = times
        rec = {
            "arm": self.arm,
            "seed": self.seed,
            "step": step,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "lr": lr,
            "tokens": tokens,
            "sent_bytes": sent,
            "received_bytes": received,
            "cum_sent_bytes": state["sent"],
            "cum_received_bytes": state["received"],
            "collectives": state["collectives"],
            "compute_s": compute_s,
            "codec_s": codec_s,
            "comm_s": comm_s,
            "eval_s": eval_s,
            "wall_s": state["wall_s"],
        }
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._bar is not None and step > 0:
            post = {"loss": f"{train_loss:.3f}", "sent": _human(state["sent"])}
            if val_loss is not None:
                post["val"] = f"{val_loss:.3f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._file.close()


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return str(n)


def read_metrics(path: Path) -> list[dict]:
    """All complete rows; a row cut short by a kill (the last line) is ignored. Any other line that is
    not a row is damage: ValueError naming the file and line, not a KeyError or TypeError later."""
    if not Path(path).exists():
        return []
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            row = None
        if not _is_row(row):
            raise ValueError(f"{path} is damaged: line {number} is not a metrics row ({line[:60]!r})")
        rows.append(row)
    return rows


def _is_row(row) -> bool:
    """Holds what selecting a job's rows needs."""
    return (
        isinstance(row, dict)
        and isinstance(row.get("arm"), str)
        and isinstance(row.get("seed"), int)
        and isinstance(row.get("step"), int)
    )


def truncate_metrics(path: Path, arm: str, seed: int, keep_through: int | None) -> None:
    """Drop this job's rows after step ``keep_through`` (all of them when None): a resume rewrites them."""
    rows = [
        r
        for r in read_metrics(path)
        if not (r["arm"] == arm and r["seed"] == seed and (keep_through is None or r["step"] > keep_through))
    ]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def job_rows(rows: list[dict], arm: str, seed: int) -> list[dict]:
    return sorted((r for r in rows if r["arm"] == arm and r["seed"] == seed), key=lambda r: r["step"])


def expected_bytes_per_collective(kind: str, payload_nbytes: int, world_size: int) -> int:
    if kind == "adamw":
        return CommStats.ring_all_reduce_bytes(payload_nbytes, world_size)
    return CommStats.all_gather_bytes(payload_nbytes, world_size)


def job_summary(rows: list[dict], result: dict) -> dict:
    """One (arm, seed): final losses, bytes per step per worker, and their check against the formula.

    A worker is one replica: in a hybrid run (``shard_degree`` S > 1) its S ranks each send their
    shard's payload, and the worker's bytes, the ratios' denominators, are their sum (what the whole
    model costs to send); ``compression_vs_dense_bf16_per_rank`` is one rank's figure, S times that.
    """
    steps = rows[-1]["step"]
    n, world = result["n_params"], result["world_size"]
    rank_sent = rows[-1]["cum_sent_bytes"]  # rank 0's (the metrics sink's), as the formula's check
    per_collective = expected_bytes_per_collective(result["kind"], result["payload_nbytes"], world)
    # an arm whose collectives differ in size (powersgd) states its own total, from the model's shapes
    expected_total = result.get("expected_sent_bytes", per_collective * rows[-1]["collectives"])
    # a compression warm-up's payload changes size: its worker added the sizes up step by step
    collectives = rows[-1]["collectives"]
    rank_message = result.get("message_bytes", result["payload_nbytes"] * collectives) / steps
    replica = result["workers"][: result.get("shard_degree", 1)]
    if len(replica) > 1:
        sent, received = sum(w["sent"] for w in replica), sum(w["received"] for w in replica)
        message = result.get("replica_message_bytes", result["replica_payload_nbytes"] * collectives) / steps
    else:
        sent, received, message = rank_sent, rows[-1]["cum_received_bytes"], rank_message
    check_bytes = CommStats.all_gather_bytes(CHECKSUM_NBYTES, world)
    val = [r for r in rows if r["val_loss"] is not None]
    steps_rows = [r for r in rows if r["step"] > 0]
    return {
        "steps": steps,
        "initial_val_loss": val[0]["val_loss"],
        "final_val_loss": val[-1]["val_loss"],
        "final_train_loss": steps_rows[-1]["train_loss"],
        "shard_degree": len(replica),
        "sent_bytes_per_step": sent / steps,
        "received_bytes_per_step": received / steps,
        "peak_sent_bytes_per_step": max(r["sent_bytes"] for r in steps_rows),  # rank 0's
        "payload_nbytes": result["payload_nbytes"],
        "expected_sent_bytes": expected_total,
        "bytes_match_formula": all(
            w["sent"] == expected_total and w["received"] == expected_total
            and w.get("check_sent", 0) == w.get("check_received", 0) == w.get("checks", 0) * check_bytes
            for w in result["workers"]
        ),
        "replica_checks": result["workers"][0].get("checks", 0),
        "replica_check_sent_bytes": result["workers"][0].get("check_sent", 0),
        "workers_sent_bytes": [w["sent"] for w in result["workers"]],
        # A backend's own framing (e.g. a length prefix) shows up here; in-process it is 0.
        "sent_minus_formula_bytes_per_step": (rank_sent - expected_total) / steps,
        "compression_vs_dense_bf16": BF16_BYTES * n / message if message else None,
        "compression_vs_dense_bf16_per_rank": BF16_BYTES * n / rank_message if rank_message else None,
        "compression_vs_ring_allreduce_bf16": CommStats.ring_all_reduce_bytes(BF16_BYTES * n, world)
        * steps
        / sent
        if sent
        else None,
        "compression_vs_naive_gather_bf16": CommStats.naive_all_reduce_bytes(BF16_BYTES * n, world)
        * steps
        / received
        if received
        else None,
        "tokens": steps_rows[-1]["tokens"],
        "wall_s": steps_rows[-1]["wall_s"],
        "compute_s_per_step": statistics.fmean(r["compute_s"] + r["codec_s"] for r in steps_rows),
        "comm_s_per_step_measured": statistics.fmean(r["comm_s"] for r in steps_rows),
    }


def reference_arm(arms: list[dict], kind: str = "adamw") -> str | None:
    """The AdamW arm gaps are measured against: the one labelled 'adamw', else a sweep's AdamW point
    at the arm's own lr (every value ``1x``), else the first AdamW arm. With ``kind="alone"``, the
    alone baseline R is measured from, chosen the same way."""
    same = [a for a in arms if a["kind"] == kind]
    labels = [a["label"] for a in same]
    if kind in labels:
        return kind
    unscaled = [a["label"] for a in same if a.get("point") and set(a["point"].values()) == {"1x"}]
    return (unscaled or labels or [None])[0]


def summarize(config: dict, rows: list[dict], results: dict) -> dict:
    """Per arm, over seeds: mean/spread of the final validation loss, paired gap vs AdamW, retained
    gain R against the alone baseline, bytes."""
    ref = reference_arm(config["arms"])
    alone = reference_arm(config["arms"], "alone")
    out = {
        "preset": config["preset"]["name"],
        "workers": config["workers"],
        "shard_degree": config["preset"].get("shard_degree", 1),
        "reference": ref,
        "alone": alone,
        "data_parallel_gain_per_seed": {},
        "n_params": None,
        "arms": {},
    }
    per_job = {}
    for arm in config["arms"]:
        for seed in config["seeds"]:
            key = f"{arm['label']}|{seed}"
            if key in results and results[key]["status"] == "done":
                job = job_rows(rows, arm["label"], seed)
                if not job:
                    raise ValueError(
                        f"metrics.jsonl holds no rows of arm {arm['label']!r} seed {seed}, "
                        "whose result file says it finished"
                    )
                per_job[(arm["label"], seed)] = job_summary(job, results[key])
                out["n_params"] = results[key]["n_params"]

    def final(label):
        return {str(s): per_job[(label, s)]["final_val_loss"] for s in config["seeds"] if (label, s) in per_job}

    alone_losses = final(alone) if alone is not None else None
    ref_losses = final(ref) if ref is not None else None
    if alone_losses and ref_losses:
        out["data_parallel_gain_per_seed"] = {
            s: alone_losses[s] - ref_losses[s] for s in alone_losses if s in ref_losses}
    for arm in config["arms"]:
        seeds = [s for s in config["seeds"] if (arm["label"], s) in per_job]
        if not seeds:
            continue
        jobs = [per_job[(arm["label"], s)] for s in seeds]
        losses = [j["final_val_loss"] for j in jobs]
        gaps = [
            100.0 * (per_job[(arm["label"], s)]["final_val_loss"] / per_job[(ref, s)]["final_val_loss"] - 1)
            for s in seeds
            if ref is not None and (ref, s) in per_job
        ]
        first = jobs[0]
        gains = retained_gains(final(arm["label"]), alone_losses, ref_losses)
        out["arms"][arm["label"]] = {
            "kind": arm["kind"],
            "seeds": seeds,
            "per_seed": {str(s): j for s, j in zip(seeds, jobs)},
            "final_val_loss_mean": statistics.fmean(losses),
            "final_val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "final_val_loss_min": min(losses),
            "final_val_loss_max": max(losses),
            "gap_vs_adamw_pct_mean": statistics.fmean(gaps) if gaps else None,
            "gap_vs_adamw_pct_per_seed": gaps,
            "retained_gain_pct_mean": mean_or_none(gains),
            "retained_gain_pct_per_seed": gains,
            "initial_val_loss": first["initial_val_loss"],
            **{
                k: first[k]
                for k in (
                    "shard_degree",
                    "sent_bytes_per_step",
                    "received_bytes_per_step",
                    "peak_sent_bytes_per_step",
                    "payload_nbytes",
                    "compression_vs_dense_bf16",
                    "compression_vs_dense_bf16_per_rank",
                    "compression_vs_ring_allreduce_bf16",
                    "compression_vs_naive_gather_bf16",
                    "tokens",
                )
            },
            "bytes_match_formula": all(j["bytes_match_formula"] for j in jobs),
            "wall_s_mean": statistics.fmean(j["wall_s"] for j in jobs),
        }
    tuned = tuned_summary(config["arms"], out["arms"], config["seeds"])
    if tuned is not None:
        out["tuned"] = tuned
    return out


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def _ratio(x) -> str:
    """A compression ratio, ``920.6x``; ``-`` for an arm that sends nothing (alone)."""
    return "-" if x is None else f"{x:,.1f}x"


def _dense_ratio(arm: dict) -> str:
    """The vs-dense ratio of a worker (a replica), with one rank's beside it in a hybrid run."""
    if arm.get("shard_degree", 1) > 1 and arm.get("compression_vs_dense_bf16") is not None:
        return f"{_ratio(arm['compression_vs_dense_bf16'])} ({_ratio(arm['compression_vs_dense_bf16_per_rank'])} per rank)"
    return _ratio(arm["compression_vs_dense_bf16"])


def markdown_table(summary: dict) -> str:
    head = (
        "| arm | final val loss | gap vs adamw | R (retained gain) | sent/step/worker | received/step/worker | "
        "vs dense bf16 | vs ring all-reduce bf16 | vs naive gather bf16 | tokens | wall time |"
    )
    lines = [
        f"Preset `{summary['preset']}`, {summary['workers']} workers, {summary['n_params']:,} parameters. "
        "Loss: mean (+- std over seeds); gap: paired per seed, mean. Bytes per worker per step.",
        "",
        gain_line(summary),
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for label, a in summary["arms"].items():
        loss = _fmt(a["final_val_loss_mean"]) + (
            f" +- {a['final_val_loss_std']:.3f}" if len(a["seeds"]) > 1 else ""
        )
        gap = "-" if a["gap_vs_adamw_pct_mean"] is None else f"{a['gap_vs_adamw_pct_mean']:+.2f}%"
        if len(a["gap_vs_adamw_pct_per_seed"]) > 1:  # a gap is real only if every seed shows it
            gap += " (" + ", ".join(f"{g:+.2f}%" for g in a["gap_vs_adamw_pct_per_seed"]) + ")"
        gain = per_seed_pct(a.get("retained_gain_pct_mean"), a.get("retained_gain_pct_per_seed", []), ".0f")
        lines.append(
            f"| {label} | {loss} | {gap} | {gain} | {_human(a['sent_bytes_per_step'])} | "
            f"{_human(a['received_bytes_per_step'])} | {_dense_ratio(a)} | "
            f"{_ratio(a['compression_vs_ring_allreduce_bf16'])} | "
            f"{_ratio(a['compression_vs_naive_gather_bf16'])} | {a['tokens']:,} | "
            f"{a['wall_s_mean']:.1f} s |"
        )
    lines += [
        "",
        "Bytes are counted by each worker's backend (`CommStats`). vs dense bf16: 2 bytes x parameters over "
        "the bytes a worker contributes per step. vs ring all-reduce: a ring all-reduce of the bf16 gradient "
        "(2(N-1)/N x 2 bytes x parameters sent). vs naive gather: (N-1) x 2 bytes x parameters received, "
        "the DisTrO report's convention. The AdamW arm all-reduces an fp32 gradient (0.5x a bf16 one); "
        "the alone arm sends nothing.",
    ]
    degree = summary.get("shard_degree", 1)
    if degree > 1:
        lines[-1] += (
            f" Hybrid run, shard degree {degree}: a worker is one replica of {degree} ranks, each "
            "sending its shard's payload; a worker's bytes and ratios are its ranks' sum (what the whole "
            f"model costs to send), and one rank's ratio, {degree} times larger, is in parentheses.")
    if summary.get("tuned"):
        lines += ["", tuned_table(summary["tuned"])]
    return "\n".join(lines) + "\n"


def write_summary(run_dir: Path, summary: dict) -> None:
    run_dir = Path(run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (run_dir / "summary.md").write_text(markdown_table(summary))


def load_run(run_dir: Path) -> tuple[dict, list[dict], dict]:
    """(config, metric rows, job results) of a run directory. A directory the runner did not write
    (missing, or without its config.json) is a FileNotFoundError saying what to point at."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        what = "does not exist" if not run_dir.exists() else "holds no config.json"
        raise FileNotFoundError(
            f"{run_dir} {what}: it is not a run directory of the experiment runner. Make one with "
            "`python -m experiments.run --preset smoke --arms adamw,distro --out DIR` and point at DIR "
            "(the notebook reads DISTRO_OPT_RUN)"
        )
    config = json.loads((run_dir / "config.json").read_text())
    results = {}
    for f in sorted((run_dir / "results").glob("*.json")):
        try:
            r = json.loads(f.read_text())
            results[f"{r['arm']}|{r['seed']}"] = r
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{f} is not a job result (damaged?)") from None
    return config, read_metrics(run_dir / "metrics.jsonl"), results
