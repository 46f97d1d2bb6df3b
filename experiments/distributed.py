"""The runner under torchrun: each rank is one worker and talks through torch.distributed.

    torchrun --nproc_per_node 8 -m experiments.run --preset llama-1.2b --arms adamw,distro --out runs/x

Every rank loads the corpus first; only once all have, rank 0 checks the run directory (and, with
--resume, the checkpoints), so that a start that fails on any rank leaves --out as it was. Rank 0
writes the metrics and the summary. The backend comes from
``distro_opt.comm.resolve_backend()`` once the default process group exists, so bytes are counted by
the same ``CommStats`` as in-process runs. The train loss is averaged with a plain
``torch.distributed.all_reduce`` outside the backend: it is bookkeeping, not training traffic.
With ``--shard-degree S`` (``experiments/hybrid.py``) each S consecutive ranks shard one replica with
FSDP2 and are one worker; the backend is the mesh's replicate group, and only its bytes are counted.
Its checkpoints go through torch.distributed.checkpoint (``checkpoint.py``); rank 0 checks their
files before any arm trains, and every rank loads them together.
Interrupting a torchrun job kills its ranks; ``--resume`` continues from the last periodic checkpoint.
A peer that dies or hangs makes each rank print one line and exit with 1 (the group is broken);
Ctrl-C, one line and 130; a start refused on any rank, the same ``error:`` line on every rank and 2.
Once its process group exists a rank leaves through process_group.end_process, never the
interpreter's finalization.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from distro_opt.cli_args import UsageError, fail, os_error_message
from distro_opt.comm import resolve_backend
from distro_opt.comm.torch_backend import CollectiveError, TorchDistributedBackend

from .checkpoint import CheckpointError, CheckpointStore
from .data import CorpusError, check_corpus_fits, load_corpus
from .hybrid import check_shard_degree, hybrid_mesh
from .metrics import MetricsSink, truncate_metrics
from .process_group import (
    EXIT_INTERRUPTED, EXIT_PEER_LOST, RendezvousError, print_one_line, run_rank, start_process_group,
)
from .train import Job, run_worker

def collective(what: str, op, *args, **kwargs):
    """A plain torch.distributed collective, whose failure (a peer died or hung) raises
    ``CollectiveError`` like the backend's own collectives, not a raw Gloo/NCCL ``RuntimeError``."""
    try:
        return op(*args, **kwargs)
    except RuntimeError as exc:
        raise CollectiveError(
            f"rank {dist.get_rank()} of {dist.get_world_size()}: {what} did not complete ({exc}). A peer "
            "rank probably died or hung; the process group cannot be used any more"
        ) from exc


class DistLossMean:
    """Train loss averaged over ranks with one small all_reduce (not counted as training bytes). The
    mean is over every rank: in a hybrid run the ranks of one replica hold the same loss, so it is
    the mean over the workers too."""

    def __init__(self, device):
        self.device = device
        self._value = None

    def put(self, step, rank, loss):
        self._value = loss

    def mean(self, step, world_size):
        t = torch.tensor([self._value], dtype=torch.float64, device=self.device)
        collective("the train loss all_reduce", dist.all_reduce, t)
        return float(t) / dist.get_world_size()


def main_distributed(args, preset, arms) -> int:
    """The runner on this rank. Returns its exit code only where no process group was started (a
    refused rendezvous file); from then on every way out ends the process (run_rank)."""
    use_cuda = preset.device.startswith("cuda") and torch.cuda.is_available()

    def start():
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = datetime.timedelta(seconds=preset.timeout_s)
        return start_process_group("nccl" if use_cuda else "gloo", timeout)

    who = f"rank {os.environ.get('RANK', '0')} of {os.environ.get('WORLD_SIZE', '?')}"
    try:
        run_rank(start, lambda: _run_ranks(args, preset, arms, use_cuda), who, "; run the same command again")
    except RendezvousError as exc:
        return fail(str(exc))


def _start_error(start) -> str | None:
    """What ``start()`` raised, as the one line ``fail`` prints; None if it returned."""
    try:
        start()
    except (CorpusError, UsageError, ValueError) as exc:
        return str(exc)
    except OSError as exc:
        return os_error_message(exc)
    return None


def _first_error(error: str | None, world: int) -> str | None:
    """Every rank's start-up error exchanged: all ranks stop if any rank cannot start."""
    errors = [None] * world
    collective("the start-up all_gather", dist.all_gather_object, errors, error)
    return next((e for e in errors if e), None)


def _advice(args, run_in_out: bool) -> str:
    """What to run after a peer was lost or Ctrl-C: --resume continues only a run that --out holds."""
    if args.resume:
        return "continue with the same command"
    if run_in_out:
        return "continue with the same command plus --resume"
    return "run the same command again"


def _run_ranks(args, preset, arms, use_cuda) -> tuple[int, bool]:
    """Start-up checks, every job, the summary; returns (exit code, whether every rank is between
    collectives, so that the group can be destroyed). A checkpoint that passed the start-up check but
    does not load (CheckpointError): its one line, exit code 2. A peer lost (CollectiveError) or Ctrl-C:
    one line with what to run next, exit code 1 or 130, the group abandoned (its lock on --out
    ends with the process)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config_path = args.out / "config.json"
    had_config = config_path.exists()  # a run there before this start (checked by prepare on rank 0)
    started = {}
    try:
        return _start_and_train(args, preset, arms, use_cuda, started)
    except CollectiveError as exc:
        code, message = EXIT_PEER_LOST, " ".join(str(exc).split()).rstrip(".")
    except CheckpointError as exc:  # passed the start-up check, yet does not load: a sharded set fails
        return fail(" ".join(str(exc).split())), False  # on every rank at once (DCP gathers the errors)
    except KeyboardInterrupt:
        code, message = EXIT_INTERRUPTED, f"rank {rank} of {world}: interrupted"
    finally:
        if started.get("sink") is not None:
            started["sink"].close()
    # --out holds this run once any rank went on to train (rank 0 prepared it), or if this start wrote
    # its config (rank 0 did, or, where --out is shared, another rank sees it)
    run_in_out = "training" in started or "lock" in started or not had_config and config_path.exists()
    print_one_line(f"{message}; {_advice(args, run_in_out)}")
    return code, False


def _start_and_train(args, preset, arms, use_cuda, started: dict) -> tuple[int, bool]:
    """``_run_ranks``'s work; ``started`` records how far it got: "corpus", "lock" (rank 0 holds --out),
    "training" (every rank passed the start-up checks), "sink" (rank 0's open metrics sink)."""
    from .run import check_checkpoints, finish, finished, record_result
    from .run_dir import prepare_out_dir, run_config

    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu"
    workers = world // preset.shard_degree  # each replica is one worker (checked in load)
    preset = type(preset)(**{**preset.__dict__, "workers": workers, "device": device})

    def load():
        check_shard_degree(world, preset.shard_degree)
        started["corpus"] = load_corpus(preset.corpus, preset.tokenizer, preset.vocab_size, args.cache)
        check_corpus_fits(started["corpus"], seq_len=preset.seq_len, workers=workers, sharding=preset.sharding)

    def prepare():  # rank 0, once every rank has its corpus: --out is touched only by a start that goes on
        corpus = started["corpus"]
        config = run_config(preset, arms, workers, corpus.vocab_size)
        started["lock"] = prepare_out_dir(args.out, config, args.resume)
        if args.resume:  # a bad checkpoint: one line naming the file, before any arm trains
            check_checkpoints(args.out, preset, arms, corpus)

    error = _first_error(_start_error(load), world)
    if error is None:
        error = _first_error(_start_error(prepare) if rank == 0 else None, world)
    if error is not None:
        return fail(error), True
    started["training"] = True
    hybrid = hybrid_mesh(torch.device(device).type, preset.shard_degree) if preset.shard_degree > 1 else None
    backend = resolve_backend() if hybrid is None else TorchDistributedBackend(group=hybrid.replicate_group)
    corpus = started["corpus"]
    for seed in preset.seed_list():
        for arm in arms:
            if finished(args.out, arm, seed):
                continue
            job = Job.create(arm, seed, preset, corpus, args.out, args.resume)
            store = CheckpointStore(args.out, arm.slug, seed, world)
            if rank == 0:
                if args.resume:
                    step = store.latest_step()
                    truncate_metrics(args.out / "metrics.jsonl", arm.label, seed, step if step > 0 else None)
                started["sink"] = MetricsSink(
                    args.out / "metrics.jsonl",
                    arm.label,
                    seed,
                    preset.steps,
                    start_step=store.latest_step() if args.resume else 0,
                    progress=not args.no_progress,
                )
            collective("the barrier before a job", dist.barrier)
            result = run_worker(backend, job, DistLossMean(device), None, started.get("sink"), hybrid)
            gathered = [None] * world if rank == 0 else None
            collective("the gather of the results", dist.gather_object, result, gathered, dst=0)
            if rank == 0:
                started.pop("sink").close()
                record_result(args.out, job, gathered)
    backend.close()
    if rank == 0:
        try:
            finish(args.out, plots=not args.no_plots)
        except ValueError as exc:  # files of the run damaged or removed by hand
            return fail(f"cannot summarize {args.out}: {exc}"), True
        print((args.out / "summary.md").read_text())
    return 0, True
