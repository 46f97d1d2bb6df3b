"""Train each arm from the same initialization on the same data, and measure loss against bytes.

    python -m experiments.run --preset smoke --arms adamw,distro --workers 4 --out runs/smoke

Writes into ``--out``: config.json (what identifies the run), metrics.jsonl (one row per step and
arm), results/ (per-worker byte totals), checkpoints/, summary.json, summary.md and PNG plots.
Workers are threads of this process (``InProcessBackend``) unless started by torchrun, where each
rank is a worker and talks through torch.distributed (``distro_opt.comm.resolve_backend``).
Ctrl-C or SIGTERM stops every worker at the same step and checkpoints it; ``--resume`` continues.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

from distro_opt.cli_args import Parser, UsageError, fail, os_error_message
from distro_opt.comm import InProcessBackend

from .arms import ALONE, check_arm, job_workers, parse_arms, with_alone
from .checkpoint import CheckpointStore
from .cli import add_preset_flags, apply_overrides
from .data import CorpusError, check_corpus_fits, load_corpus
from .coordination import LossTable, StopSignal
from .files import write_atomic
from .metrics import MetricsSink, load_run, summarize, truncate_metrics, write_summary
from .model import parameter_shapes
from .peer_arms import peer_start_error
from .presets import PRESETS, Preset, get_preset
from .run_dir import prepare_out_dir, run_config
from .sweep import expand, parse_sweep
from .train import COUNTERS, Job, check_resumable, run_worker

EXIT_INTERRUPTED = 130


def build_parser() -> Parser:
    p = Parser(
        prog="python -m experiments.run",
        description=__doc__.split("\n\n")[0],
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=40),
    )
    p.add_argument("--preset", default="smoke", help=f"one of: {', '.join(PRESETS)} (default smoke)")
    p.add_argument("--out", required=True, type=Path, help="run directory (created; never overwritten)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="token cache (default $DISTRO_OPT_CACHE or .cache/distro-opt)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--no-alone",
        action="store_true",
        help="do not add the alone arm (AdamW on one worker, same per-worker batch and steps, no network), "
        "which an in-process run of several workers with an adamw arm otherwise adds to measure each "
        "arm's retained gain R (under torchrun it is not added: run it in-process)",
    )
    add_preset_flags(p, Preset, PRESETS)
    p.epilog = (
        "Arms: adamw (torch AdamW, gradients all-reduced through the same backend), distro "
        "(DisTrOAdamW), demo (DeMo); options as kind:key=value,... e.g. distro:topk=8,bits=2 "
        "(topk, bits, chunk, decay, wd, or any keyword of the optimizer). diloco: DiLoCo "
        "(arXiv 2311.08455) as DisTrOAdamW's local-step mode, inner AdamW, every H steps (diloco:H=30) "
        "the whole pseudo-gradient (every DCT coefficient, bf16, with its indices: the bytes it sends), "
        "outer Nesterov SGD lr 0.7, momentum 0.9. Under torch.distributed only (torchrun): demo-peer "
        "(pytorch_optimizer.DeMo; bytes: its int64-index + value all-gathers, checked against its own "
        "counters) and powersgd (torch AdamW, DDP with torch's PowerSGD hook, powersgd:rank=4,start_iter=30; "
        "bytes: ring all-reduces of its P, Q and uncompressed tensors, dense before start_iter). "
        "--sweep \"lr=0.5x,1x,2x,4x\" runs every arm at each lr (a multiple of its own, or a number) and "
        "reports the best point of each against AdamW's best; \";outer_lr=0.7,1\" adds the outer lr for "
        "arms with local steps."
    )
    return p


def _result_path(out: Path, arm, seed: int) -> Path:
    return out / "results" / f"{arm.slug}-seed{seed}.json"


def finished(out: Path, arm, seed: int) -> bool:
    """Whether the job's result file says it is done. A damaged or torn one (written by a version
    without atomic writes, or edited) does not count: the job is run again from its checkpoint."""
    try:
        result = json.loads(_result_path(out, arm, seed).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(result, dict) and result.get("status") == "done"


def check_checkpoints(out: Path, preset: Preset, arms, corpus) -> None:
    """--resume: every unfinished job's newest checkpoint set must load (``CheckpointError`` otherwise),
    checked before the first arm trains, so that a bad file of the last arm is not found hours in.
    A hybrid run's sets are loaded by every rank together, so here (one rank) their files and index
    are checked instead (``CheckpointStore.check_sharded``)."""
    shapes = parameter_shapes(preset.model_config(corpus.vocab_size))
    for seed in preset.seed_list():
        for arm in arms:
            if finished(out, arm, seed):
                continue
            if preset.shard_degree > 1 and arm.kind != ALONE:  # alone: one whole replica, plain files
                store = CheckpointStore(out, arm.slug, seed, preset.workers * preset.shard_degree)
                store.check_sharded(preset.shard_degree, shapes)
            else:
                check_resumable(Job.create(arm, seed, preset, corpus, out, resume=True),
                                job_workers(arm, preset.workers))


def run_job_in_process(job: Job, workers: int, stop: StopSignal, progress: bool) -> list[dict]:
    workers = job_workers(job.arm, workers)
    sink = MetricsSink(
        job.out / "metrics.jsonl",
        job.arm.label,
        job.seed,
        job.preset.steps,
        start_step=CheckpointStore(job.out, job.arm.slug, job.seed, workers).latest_step()
        if job.resume
        else 0,
        progress=progress,
    )
    losses = LossTable(job.preset.timeout_s)
    try:
        return InProcessBackend.run(
            workers,
            lambda b: run_worker(b, job, losses, stop, sink if b.rank == 0 else None),
            timeout_s=job.preset.timeout_s,
        )
    finally:
        sink.close()


def record_result(out: Path, job: Job, workers: list[dict]) -> None:
    if job.arm.kind == ALONE:  # torchrun: every rank trained the same alone arm; one is the arm
        workers = workers[:1]
    first = workers[0]
    # a hybrid run's ranks 0..S-1 are replica 0 (consecutive ranks shard one replica): its ranks'
    # payloads together are what the whole model costs to send
    replica = workers[: len(workers) // first["world_size"]]
    result = {
        "arm": job.arm.label,
        "kind": job.arm.kind,
        "seed": job.seed,
        "status": first["status"],
        "world_size": first["world_size"],  # the workers (replicas) exchanging payloads
        "payload_nbytes": first["payload_nbytes"],
        "n_params": first["n_params"],
        # arms whose payload size changes (a compression warm-up) or whose collectives differ (powersgd)
        **{k: first[k] for k in ("expected_sent_bytes", "message_bytes") if k in first},
        "shard_degree": len(replica),
        "replica_payload_nbytes": sum(w["payload_nbytes"] for w in replica),
        **({"replica_message_bytes": sum(w["message_bytes"] for w in replica)} if "message_bytes" in first else {}),
        "workers": [
            {k: w[k] for k in ("rank", *COUNTERS, "wall_s")} for w in workers
        ],
    }
    if first["status"] == "done":
        write_atomic(_result_path(out, job.arm, job.seed), json.dumps(result, indent=1))


def finish(out: Path, plots: bool) -> dict:
    config, rows, results = load_run(out)
    summary = summarize(config, rows, results)
    write_summary(out, summary)
    if plots and summary["arms"]:
        from .plots import make_plots

        make_plots(out, config, rows, summary)
    return summary


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        preset = apply_overrides(get_preset(args.preset), args)
        arms = parse_arms(preset.arms)  # first: what was typed, before what the preset brings
        distributed = "WORLD_SIZE" in os.environ
        if distributed and any(a.kind == ALONE for a in arms):
            raise ValueError("the alone arm (one worker, no network) runs in-process: run it without "
                             "torchrun, with the same preset flags")
        typed = arms
        if not args.no_alone and not distributed:
            arms = with_alone(arms, preset.workers)
        arms = expand(arms, parse_sweep(preset.sweep), preset.lr)
        preset.validate()
        for arm in arms:
            check_arm(arm, preset)
        if refusal := peer_start_error(  # named as typed: the alone arm is the runner's own
            expand(typed, parse_sweep(preset.sweep), preset.lr), args.resume, distributed=distributed,
            shard_degree=preset.shard_degree,
        ):
            raise ValueError(refusal)
    except ValueError as exc:
        return fail(str(exc))
    threads = torch.get_num_threads()
    if preset.torch_threads > 0:
        torch.set_num_threads(preset.torch_threads)
    try:
        if "WORLD_SIZE" in os.environ:
            from .distributed import main_distributed

            return main_distributed(args, preset, arms)
        if preset.shard_degree > 1:
            return fail(f"shard_degree {preset.shard_degree} needs torchrun (ranks to shard the model "
                        "over); in-process workers hold whole replicas: pass --shard-degree 1")
        return run_in_process(args, preset, arms)
    finally:
        torch.set_num_threads(threads)  # a caller in the same process (a test) keeps its setting


def run_in_process(args, preset: Preset, arms) -> int:
    """Every arm and seed with ``preset.workers`` threads as workers; then the summary and plots."""
    try:
        corpus = load_corpus(preset.corpus, preset.tokenizer, preset.vocab_size, args.cache)
        check_corpus_fits(corpus, seq_len=preset.seq_len, workers=preset.workers, sharding=preset.sharding)
        config = run_config(preset, arms, preset.workers, corpus.vocab_size)
        lock = prepare_out_dir(args.out, config, args.resume)
    except (CorpusError, UsageError, ValueError) as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(os_error_message(exc))
    try:
        return _train_in_process(args, preset, arms, corpus)
    finally:
        if lock is not None:
            lock.close()


def _train_in_process(args, preset: Preset, arms, corpus) -> int:
    if args.resume:
        try:
            check_checkpoints(args.out, preset, arms, corpus)
        except ValueError as exc:  # CheckpointError
            return fail(str(exc))
        except OSError as exc:
            return fail(os_error_message(exc))
    stop = StopSignal()
    previous = {s: signal.signal(s, stop.request) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for seed in preset.seed_list():
            for arm in arms:
                if finished(args.out, arm, seed):
                    continue  # finished before an interruption
                if stop.requested:
                    print(
                        "interrupted between arms; continue with the same command plus --resume",
                        file=sys.stderr,
                    )
                    return EXIT_INTERRUPTED
                job = Job.create(arm, seed, preset, corpus, args.out, args.resume)
                if args.resume:
                    step = CheckpointStore(args.out, arm.slug, seed, job_workers(arm, preset.workers)).latest_step()
                    truncate_metrics(args.out / "metrics.jsonl", arm.label, seed, step if step > 0 else None)
                workers = run_job_in_process(job, preset.workers, stop, progress=not args.no_progress)
                record_result(args.out, job, workers)
                if workers[0]["status"] == "interrupted":
                    print(
                        f"interrupted at step {workers[0]['step']} of {arm.label} (seed {seed}); "
                        f"metrics so far are in {args.out / 'metrics.jsonl'}; "
                        "continue with the same command plus --resume",
                        file=sys.stderr,
                    )
                    return EXIT_INTERRUPTED
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    try:
        summary = finish(args.out, plots=not args.no_plots)
    except ValueError as exc:  # files of the run damaged or removed by hand
        return fail(f"cannot summarize {args.out}: {exc}")
    print((args.out / "summary.md").read_text())
    bad = [a for a, s in summary["arms"].items() if not s["bytes_match_formula"]]
    if bad:
        print(f"warning: measured bytes differ from the formula for: {', '.join(bad)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
