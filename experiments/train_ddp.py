"""Train a small MLP with DisTrOAdamW across real processes, in place of DDP.

    torchrun --standalone --nproc-per-node 2 -m experiments.train_ddp --steps 20
    torchrun --standalone --nproc-per-node 1 -m experiments.train_ddp --device cuda   # NCCL
    python -m experiments.train_ddp --help

Each rank holds a full copy of the model (no DDP wrapper: the optimizer does the communication,
one all-gather of a compressed payload per step) and trains on its own batches of a synthetic
teacher task. Rank 0 prints one line per step: loss | bytes sent | comm s | step s. At the end,
every rank prints a checksum of its parameters, which must be identical on all ranks.

Without torchrun's environment the script runs as a world of one on 127.0.0.1.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distro_opt import DisTrOAdamW
from distro_opt.comm.torch_backend import CollectiveError, TorchDistributedBackend
from distro_opt.experiments.process_group import single_process_group, start_process_group


HELP = {
    "steps": "optimizer steps to run",
    "seed": "seed of the weights and of every rank's data",
    "batch_size": "samples per rank per step",
    "in_features": "MLP input width",
    "hidden": "MLP hidden width (two hidden layers)",
    "out_features": "MLP output width",
    "lr": "DisTrOAdamW learning rate (size of the sign step)",
    "compression_topk": "DCT coefficients sent per chunk",
    "compression_chunk": "DCT chunk size per dimension",
    "compression_bits": "bits per sent value",
    "overlap": "apply each step's update one step late, so its all-gather overlaps the next step",
    "dtype": "parameter dtype: float32 or bfloat16",
    "autocast": "run the forward under torch.autocast(bfloat16)",
    "grad_scaler": "use torch.amp.GradScaler (a rank with inf grads contributes nothing that step)",
    "inject_inf": "RANK:STEP: that rank's loss is inf at that step (shows GradScaler's skipped step)",
    "device": "cpu (Gloo) or cuda (NCCL)",
    "timeout_s": "process-group timeout and bound on each wait for a collective, in seconds",
    "save_dir": "write DIR/rank{r}.pt at the end (an existing file is never overwritten)",
    "resume_dir": "start from the checkpoints in DIR, saved by any world size",
    "log": "rank 0 prints one line per step",
}
DTYPES = ("float32", "bfloat16")


@dataclass
class TrainConfig:
    steps: int = 20
    seed: int = 0
    batch_size: int = 32
    in_features: int = 16
    hidden: int = 64
    out_features: int = 8
    lr: float = 1e-2
    compression_topk: int = 4
    compression_chunk: int = 64
    compression_bits: int = 1
    overlap: bool = False
    dtype: str = "float32"
    autocast: bool = False
    grad_scaler: bool = False
    inject_inf: str = ""
    device: str = "cpu"
    timeout_s: float = 60.0
    save_dir: str = ""
    resume_dir: str = ""
    log: bool = True

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"Invalid dtype: {self.dtype!r} (expected one of {DTYPES})")
        if not self.steps >= 0:
            raise ValueError(f"Invalid steps: {self.steps}")
        if self.inject_inf and not (self.inject_inf.count(":") == 1
                                    and all(x.isdigit() for x in self.inject_inf.split(":"))):
            raise ValueError(f"Invalid inject_inf: {self.inject_inf!r} (expected RANK:STEP)")

    @classmethod
    def from_args(cls, argv=None) -> "TrainConfig":
        parser = argparse.ArgumentParser(
            prog="experiments.train_ddp", description=__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for f in dataclasses.fields(cls):
            flag, helptext = "--" + f.name.replace("_", "-"), HELP.get(f.name, "")
            if f.type == "bool":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=helptext)
            else:
                kind = {"int": int, "float": float}.get(f.type, str)
                parser.add_argument(flag, type=kind, default=f.default,
                                    help=helptext + " (default: %(default)s)")
        return cls(**vars(parser.parse_args(argv)))


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


def train(cfg: TrainConfig, comm, log=None) -> dict:
    """Train on ``comm`` (any distro_opt Backend); return losses, timings, bytes and final parameters."""
    rank, device = comm.rank, torch.device(cfg.device)
    model = TinyMLP(cfg)
    init_params(model, cfg.seed)
    model.to(device=device, dtype=getattr(torch, cfg.dtype))
    opt = DisTrOAdamW(
        model.parameters(), lr=cfg.lr, compression_topk=cfg.compression_topk,
        compression_chunk=cfg.compression_chunk, compression_bits=cfg.compression_bits,
        comm=comm, overlap=cfg.overlap,
    )
    start = load_checkpoint(cfg.resume_dir, rank, comm.world_size, model, opt) if cfg.resume_dir else 0
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
        save_checkpoint(cfg.save_dir, rank, comm.world_size, start + cfg.steps, model, opt)
    return {
        "losses": losses, "step_s": step_s, "comm_s": comm_s, "eval_loss_start": eval_start,
        "eval_loss": evaluate(model, cfg, device),
        "bytes_sent": comm.stats.bytes_sent, "payload_nbytes": opt.payload_nbytes,
        "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    }


def save_checkpoint(directory: str, rank: int, world_size: int, step: int, model, opt) -> Path:
    """Write ``directory/rank{rank}.pt``; refuse to overwrite an existing checkpoint."""
    path = Path(directory) / f"rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "world_size": world_size, "step": step}
    with open(path, "xb") as f:  # "x": fails if the file exists
        torch.save(state, f)
    return path


def load_checkpoint(directory: str, rank: int, world_size: int, model, opt) -> int:
    """Resume rank ``rank`` of ``world_size`` from checkpoints saved by any world size; return the step.

    Parameters and the Adam-like state are identical on every saving rank (every rank applies the
    same aggregate), so any file serves them. Only the error-feedback buffer ``delta`` is a rank's
    own: what it computed but did not send yet. A rank that existed before resumes with its own
    file; a new rank takes rank 0's file with ``delta`` zeroed (it has sent nothing; copying rank 0's
    residual would send it twice). When shrinking, the residuals of the removed ranks are dropped
    (a warning says so): a small loss of not-yet-sent momentum, not an inconsistency.
    """
    files = sorted(Path(directory).glob("rank*.pt"))
    if not files:
        raise FileNotFoundError(f"No checkpoint files rank*.pt in {directory!r}")
    own = Path(directory) / f"rank{rank}.pt"
    state = torch.load(own if own.exists() else files[0], map_location="cpu", weights_only=False)
    saved_ws = state["world_size"]
    if len(files) != saved_ws:
        raise ValueError(f"Checkpoint {directory!r} is incomplete: {len(files)} of {saved_ws} rank files")
    if rank >= saved_ws:
        state = torch.load(Path(directory) / "rank0.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if rank >= saved_ws:
        for s in opt.state.values():
            if "delta" in s:
                s["delta"].zero_()
    if rank == 0 and saved_ws > world_size:
        warnings.warn(f"resuming {saved_ws} ranks as {world_size}: the unsent residual momentum of ranks "
                      f"{world_size}..{saved_ws - 1} is dropped")
    return state["step"]


def checksum(params: dict) -> str:
    """A short digest of the exact parameter bits, to compare ranks by eye."""
    digest = hashlib.sha256()
    for v in params.values():
        digest.update(v.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def init_group(cfg: TrainConfig) -> None:
    """Start the process group: torchrun's (or a hand launch's), else a group of this process alone."""
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if "RANK" in os.environ:
        start_process_group(backend, timeout)
    else:
        single_process_group(backend, timeout)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def main(argv=None) -> None:
    cfg = TrainConfig.from_args(argv)
    if cfg.device.startswith("cuda"):
        cfg = dataclasses.replace(cfg, device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    init_group(cfg)
    comm = TorchDistributedBackend(timeout_s=cfg.timeout_s)
    if comm.rank == 0:
        print(f"world size {comm.world_size} | {dist.get_backend()} | {cfg}", flush=True)
    try:
        log = (lambda line: print(line, flush=True)) if cfg.log and comm.rank == 0 else None
        result = train(cfg, comm, log=log)
    except CollectiveError as exc:
        print(f"rank {comm.rank}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # the group is broken; let torchrun tear the job down
    print(f"rank {comm.rank}: eval loss {result['eval_loss']:.6f} | params {checksum(result['params'])} "
          f"| payload {result['payload_nbytes']} B/step | sent {result['bytes_sent']} B "
          f"| mean step {sum(result['step_s']) / max(1, len(result['step_s'])):.4f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
