"""Train a small MLP with DisTrOAdamW across real processes, in place of DDP.

    torchrun --standalone --nproc-per-node 2 -m experiments.train_ddp --steps 20
    torchrun --standalone --nproc-per-node 1 -m experiments.train_ddp --device cuda   # NCCL
    python -m experiments.train_ddp --help

Each rank holds a full copy of the model (no DDP wrapper: the optimizer does the communication,
one all-gather of a compressed payload per step) and trains on its own batches of a synthetic
teacher task. Rank 0 prints one line per step: loss | bytes sent | comm s | step s. At the end,
every rank prints a checksum of its parameters, which must be identical on all ranks.

Before the first step the ranks exchange their start-up checks (the --save-dir and --resume-dir
files, the arguments, then a checksum of the starting parameters): if any rank cannot start, or
the ranks would not train the same model, every rank stops with the same one-line error.

With --shard-degree S (a hybrid run, ``experiments/hybrid.py``) each S consecutive ranks hold one
replica, its layers sharded over them with FSDP2, and train on the same batches; DisTrOAdamW talks
over the replicate group only, and the bytes printed are that group's. Such a run saves and resumes
through torch.distributed.checkpoint (``ddp_checkpoint.save_sharded_checkpoint``), on the world size
and shard degree that saved it.

Without torchrun's environment the script runs as a world of one (its Gloo socket on 127.0.0.1).

Exit codes: 0 trained (the checksum line); else one line on stderr: 2 bad arguments, or a start
refused on any rank ("error: ...", the same line on every rank); 1 a peer died or hung (or never
came), this rank's save failed, or a bug (with its traceback); 130 Ctrl-C. Once its process group
exists a rank leaves through process_group.end_process, never the interpreter's finalization.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distro_opt import DisTrOAdamW
from distro_opt.cli_args import fail
from distro_opt.comm.torch_backend import CollectiveError, TorchDistributedBackend
from distro_opt.shards import is_sharded
from distro_opt.experiments.ddp_checkpoint import (
    check_checkpoint_set, check_save_dir, load_checkpoint, save_checkpoint, save_sharded_checkpoint,
)
from distro_opt.experiments.hybrid import check_shard_degree, hybrid_mesh, shard_model
from distro_opt.experiments.process_group import (
    EXIT_PEER_LOST, RendezvousError, print_one_line, run_rank, single_process_group, start_process_group,
)
from distro_opt.experiments.sharded_checkpoint import check_layout, checksum
from distro_opt.experiments.train_ddp_config import TrainConfig


class TinyMLP(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.in_features, cfg.hidden), nn.GELU(),
            nn.Linear(cfg.hidden, cfg.hidden), nn.GELU(),
            nn.Linear(cfg.hidden, cfg.out_features),
        )

    def forward(self, x):
        return self.layers(x)


@torch.no_grad()
def init_params(model: nn.Module, seed: int) -> None:
    """Same weights on every rank, from a private generator (no global RNG: ranks may be threads)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        bound = 1 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.1
        p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))


def make_batch(cfg: TrainConfig, rank: int, step: int):
    """Rank ``rank``'s batch for ``step`` (rank=-1: the held-out batch): targets of a fixed teacher."""
    teacher_gen = torch.Generator().manual_seed(cfg.seed + 7)
    teacher = torch.randn(cfg.in_features, cfg.out_features, generator=teacher_gen)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + (rank + 1) * 10_007 + step)
    x = torch.randn(cfg.batch_size, cfg.in_features, generator=gen)
    return x, torch.sin(x @ teacher / math.sqrt(cfg.in_features))


def evaluate(model: nn.Module, cfg: TrainConfig, device) -> float:
    x, y = make_batch(cfg, -1, 0)
    with torch.no_grad():
        out = model(x.to(device, getattr(torch, cfg.dtype)))
    return F.mse_loss(out.float(), y.to(device)).item()


def train(cfg: TrainConfig, comm, log=None, on_start=None, hybrid=None) -> dict:
    """Train on ``comm`` (any distro_opt Backend); return losses, timings, bytes and final parameters.
    ``on_start(model)`` runs once the starting parameters are in place, before the first step.
    ``hybrid`` (``hybrid.HybridMesh``): the layers are then sharded over its shard dimension, and
    ``comm`` must be its replicate group; the returned parameters are the full (gathered) ones, and
    checkpoints go through torch.distributed.checkpoint, one per run with every rank's shards."""
    rank, device = comm.rank, torch.device(cfg.device)
    # a checkpoint's rank files are the whole world's: in a hybrid run, one per rank of the mesh
    file_rank, file_world = (hybrid.rank, hybrid.world_size) if hybrid is not None else (rank, comm.world_size)
    if cfg.save_dir and (cfg.steps > 0 or file_world == 1):
        # Found now, not after the whole run. The first step's collective orders every rank's check
        # before any rank's save (in a hybrid run, the save's own first collective does); with no
        # step nothing does (another rank's new file would make this check refuse), and there is no
        # run to lose: the save itself refuses to overwrite.
        check_save_dir(cfg.save_dir)
    model = TinyMLP(cfg)
    init_params(model, cfg.seed)
    model.to(device=device, dtype=getattr(torch, cfg.dtype))
    if hybrid is not None:  # before the optimizer, which must hold the sharded parameters
        if on_start is not None:  # whole tensors, comparable across ranks; a checkpoint loaded next
            on_start(model)  # is one DCP save, read alike by every rank
        shard_model(model, [m for m in model.layers if isinstance(m, nn.Linear)], hybrid)
    opt = DisTrOAdamW(
        model.parameters(), lr=cfg.lr, compression_topk=cfg.compression_topk,
        compression_chunk=cfg.compression_chunk, compression_bits=cfg.compression_bits,
        comm=comm, overlap=cfg.overlap,
    )
    start = load_checkpoint(cfg.resume_dir, file_rank, file_world, model, opt) if cfg.resume_dir else 0
    if on_start is not None and hybrid is None:
        on_start(model)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.grad_scaler)
    inf_rank, inf_step = map(int, cfg.inject_inf.split(":")) if cfg.inject_inf else (-1, -1)
    eval_start = evaluate(model, cfg, device)
    losses, step_s, comm_s = [], [], []
    for step in range(start, start + cfg.steps):
        t0 = time.perf_counter()
        sent0 = comm.stats.bytes_sent
        x, y = make_batch(cfg, rank, step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast):
            out = model(x.to(device, getattr(torch, cfg.dtype)))
        loss = F.mse_loss(out.float(), y.to(device))
        if (rank, step) == (inf_rank, inf_step):
            loss = loss * float("inf")
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)  # DisTrOAdamW handles inf grads itself: every rank joins the collective
        scaler.update()
        losses.append(loss.item())
        step_s.append(time.perf_counter() - t0)
        comm_s.append(opt.last_step_timing["comm_s"])
        if log is not None:
            log(f"step {step + 1:4d} | loss {losses[-1]:.5f} | sent {comm.stats.bytes_sent - sent0:6d} B "
                f"| comm {comm_s[-1]:.4f} s | step {step_s[-1]:.4f} s")
    opt.flush()  # overlap mode: apply the last step's update
    if cfg.save_dir:
        save = save_checkpoint if hybrid is None else save_sharded_checkpoint
        save(cfg.save_dir, file_rank, file_world, start + cfg.steps, model, opt)
    return {
        "losses": losses, "step_s": step_s, "comm_s": comm_s, "eval_loss_start": eval_start,
        "eval_loss": evaluate(model, cfg, device),
        "bytes_sent": comm.stats.bytes_sent, "payload_nbytes": opt.payload_nbytes,
        "params": {k: (v.full_tensor() if is_sharded(v) else v).detach().cpu().clone()
                   for k, v in model.state_dict().items()},
    }


def init_group(cfg: TrainConfig) -> Path | None:
    """Start the process group: torchrun's (or a hand launch's), else a group of this process alone.
    Returns the rendezvous file of a hand launch (start_process_group), else None."""
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if backend == "nccl":  # before the group: nothing started is left behind if the GPU is missing
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ:
        return start_process_group(backend, timeout)
    single_process_group(backend, timeout)
    return None


def optimizer_group(cfg: TrainConfig, comm):
    """(hybrid mesh or None, the backend the optimizer talks over): ``comm`` (the whole world), or in
    a hybrid run the mesh's replicate group, one rank per replica."""
    if cfg.shard_degree == 1:
        return None, comm
    hybrid = hybrid_mesh(torch.device(cfg.device).type, cfg.shard_degree)
    return hybrid, TorchDistributedBackend(group=hybrid.replicate_group, timeout_s=cfg.timeout_s)


def start_checks(cfg: TrainConfig, rank: int, world_size: int) -> str | None:
    """This rank's start-up problem, or the ranks' disagreement, exchanged: every rank gets the same
    answer (None: all can start), so that none starts training while another stops."""
    problem = None
    try:
        if cfg.save_dir:
            check_save_dir(cfg.save_dir)
        check_shard_degree(world_size, cfg.shard_degree)
        if cfg.resume_dir:
            saved = check_checkpoint_set(cfg.resume_dir)
            check_layout(f"--resume-dir {cfg.resume_dir}", saved, (world_size, cfg.shard_degree))
    except (OSError, ValueError) as exc:
        problem = f"rank {rank}: {exc}"
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_RANK}
    settings["device"] = cfg.device.split(":")[0]  # cuda:LOCAL_RANK differs per rank
    seen = [None] * world_size
    dist.all_gather_object(seen, (problem, settings))
    problems = [p for p, _ in seen if p]
    if problems:
        return problems[0]
    differ = [k for k in settings if len({repr(s[k]) for _, s in seen}) > 1]
    if differ:
        values = "; ".join(f"{k}: " + ", ".join(repr(s[k]) for _, s in seen) for k in differ)
        return f"the ranks were started with different arguments ({values}); start every rank alike"
    return None


PER_RANK = ("save_dir", "resume_dir", "log")  # may differ across ranks (e.g. each machine's disk)


def check_same_start(model: nn.Module) -> None:
    """Refuse ranks that would start from different parameters: nothing makes them equal here (DDP
    broadcasts rank 0's at construction; DisTrOAdamW does not), and every rank applying the same
    update to different parameters never converges. DisTrOAdamW compares its trainable parameters
    at its first step; this compares the whole state dict, buffers included, before anything runs."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, checksum(model.state_dict()))
    if len(set(seen)) > 1:
        raise ValueError(
            "the ranks start from different parameters (checksums: "
            + ", ".join(f"rank {r}: {c}" for r, c in enumerate(seen)) + "); every rank must start from "
            "the same model: the same seed and checkpoint, or rank 0's parameters broadcast to all"
        )


def main(argv=None) -> int:
    """The script. Returns its exit code only where no process group was started (bad arguments, a
    refused rendezvous file); from then on every way out ends the process (run_rank)."""
    cfg = TrainConfig.from_args(argv, description=__doc__)
    if cfg.device.startswith("cuda"):
        cfg = dataclasses.replace(cfg, device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    try:
        run_rank(lambda: init_group(cfg), lambda: _main(cfg), f"rank {os.environ.get('RANK', '0')}")
    except RendezvousError as exc:
        return fail(str(exc))


def _main(cfg: TrainConfig) -> tuple[int, bool]:
    """Start-up checks, training and the closing line; returns (exit code, whether every rank is
    between collectives, so that the group can be destroyed)."""
    comm = TorchDistributedBackend(timeout_s=cfg.timeout_s)
    if comm.rank == 0:
        print(f"world size {comm.world_size} | {dist.get_backend()} | {cfg}", flush=True)
    try:
        problem = start_checks(cfg, comm.rank, comm.world_size)
        if problem is None:
            log = (lambda line: print(line, flush=True)) if cfg.log and comm.rank == 0 else None
            hybrid, replicas = optimizer_group(cfg, comm)
            result = train(cfg, replicas, log=log, on_start=check_same_start, hybrid=hybrid)
    except ValueError as exc:  # check_same_start, a payload mismatch: raised alike on every rank
        problem = str(exc)
    except (CollectiveError, dist.DistError) as exc:  # the group is broken
        print_one_line(f"rank {comm.rank}: {exc}")
        return EXIT_PEER_LOST, False
    except OSError as exc:  # this rank's save (or its second look at --save-dir) failed: its peers'
        print_one_line(f"rank {comm.rank}: {exc}")  # next collective with it fails
        return EXIT_PEER_LOST, False
    if problem is not None:
        return fail(problem), True
    print(f"rank {comm.rank}: eval loss {result['eval_loss']:.6f} | params {checksum(result['params'])} "
          f"| payload {result['payload_nbytes']} B/step | sent {result['bytes_sent']} B "
          f"| mean step {sum(result['step_s']) / max(1, len(result['step_s'])):.4f} s", flush=True)
    return 0, True


if __name__ == "__main__":
    sys.exit(main())
