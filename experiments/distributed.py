"""The runner under torchrun: each rank is one worker and talks through torch.distributed.

    torchrun --nproc_per_node 8 -m experiments.run --preset llama-1.2b --arms adamw,distro --out runs/x

Rank 0 checks the run directory, writes the metrics and the summary. The backend comes from
``distro_opt.comm.resolve_backend()`` once the default process group exists, so bytes are counted by
the same ``CommStats`` as in-process runs. The train loss is averaged with a plain
``torch.distributed.all_reduce`` outside the backend: it is bookkeeping, not training traffic.
Interrupting a torchrun job kills its ranks; ``--resume`` continues from the last periodic checkpoint.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from distro_opt.comm import resolve_backend

from .checkpoint import CheckpointStore
from .cli import UsageError, fail, os_error_message
from .data import CorpusError, check_corpus_fits, load_corpus
from .metrics import MetricsSink, truncate_metrics
from .process_group import start_process_group
from .train import Job, run_worker


class DistLossMean:
    """Train loss averaged over ranks with one small all_reduce (not counted as training bytes)."""

    def __init__(self, device):
        self.device = device
        self._value = None

    def put(self, step, rank, loss):
        self._value = loss

    def mean(self, step, world_size):
        t = torch.tensor([self._value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t) / world_size


def main_distributed(args, preset, arms) -> int:
    from .run import check_checkpoints, finish, finished, prepare_out_dir, record_result, run_config

    use_cuda = preset.device.startswith("cuda") and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    start_process_group("nccl" if use_cuda else "gloo", datetime.timedelta(seconds=preset.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu"
    preset = type(preset)(**{**preset.__dict__, "workers": world, "device": device})
    error, lock = None, None
    try:
        corpus = load_corpus(preset.corpus, preset.tokenizer, preset.vocab_size, args.cache)
        check_corpus_fits(corpus, seq_len=preset.seq_len, workers=world, sharding=preset.sharding)
        if rank == 0:
            lock = prepare_out_dir(args.out, run_config(preset, arms, world, corpus.vocab_size), args.resume)
            if args.resume:  # a bad checkpoint: one line naming the file, before any arm trains
                check_checkpoints(args.out, preset, arms, corpus)
    except (CorpusError, UsageError, ValueError) as exc:
        error = str(exc)
    except OSError as exc:
        error = os_error_message(exc)
    errors = [None] * world
    dist.all_gather_object(errors, error)  # every rank stops if any rank cannot start
    if any(errors):
        if lock is not None:
            lock.close()
        dist.destroy_process_group()
        return fail(next(e for e in errors if e))
    backend = resolve_backend()
    try:
        for seed in preset.seed_list():
            for arm in arms:
                if finished(args.out, arm, seed):
                    continue
                job = Job.create(arm, seed, preset, corpus, args.out, args.resume)
                store = CheckpointStore(args.out, arm.slug, seed, world)
                sink = None
                if rank == 0:
                    if args.resume:
                        step = store.latest_step()
                        truncate_metrics(
                            args.out / "metrics.jsonl", arm.label, seed, step if step > 0 else None
                        )
                    sink = MetricsSink(
                        args.out / "metrics.jsonl",
                        arm.label,
                        seed,
                        preset.steps,
                        start_step=store.latest_step() if args.resume else 0,
                        progress=not args.no_progress,
                    )
                dist.barrier()
                result = run_worker(backend, job, DistLossMean(device), None, sink)
                gathered = [None] * world if rank == 0 else None
                dist.gather_object(result, gathered, dst=0)
                if rank == 0:
                    sink.close()
                    record_result(args.out, job, gathered)
        if rank == 0:
            finish(args.out, plots=not args.no_plots)
            print((args.out / "summary.md").read_text())
    finally:
        if lock is not None:
            lock.close()
        backend.close()
        dist.destroy_process_group()
    return 0
