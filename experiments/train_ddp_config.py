"""experiments.train_ddp's settings: one dataclass, validated on construction, and its command line
(one flag per field; a bad value is one line and exit code 2)."""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distro_opt.cli_args import Parser


HELP = {
    "steps": "optimizer steps to run in this launch (with --resume-dir: steps after the checkpoint's, not a total)",
    "seed": "seed of the weights and of every rank's data",
    "batch_size": "samples per rank per step",
    "in_features": "MLP input width",
    "hidden": "MLP hidden width (two hidden layers)",
    "out_features": "MLP output width",
    "lr": "DisTrOAdamW learning rate",
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
    "save_dir": "write DIR/rank{r}.pt at the end (with --shard-degree, beside the model in DCP's format); "
                "DIR must hold no checkpoint (none is overwritten)",
    "resume_dir": "start from the checkpoints in DIR, saved by any world size, or by this world size and "
                  "shard degree if sharded (save to another DIR)",
    "log": "rank 0 prints one line per step",
    "shard_degree": "ranks per replica, its layers sharded over them with FSDP2 (the world size a multiple of S)",
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
    shard_degree: int = 1

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"Invalid dtype: {self.dtype!r} (expected one of {DTYPES})")
        if not self.steps >= 0:
            raise ValueError(f"Invalid steps: {self.steps}")
        for name in ("batch_size", "in_features", "hidden", "out_features"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"Invalid {name}: {getattr(self, name)} (expected >= 1)")
        if self.inject_inf and not (self.inject_inf.count(":") == 1
                                    and all(x.isdigit() for x in self.inject_inf.split(":"))):
            raise ValueError(f"Invalid inject_inf: {self.inject_inf!r} (expected RANK:STEP)")
        if not self.shard_degree >= 1:
            raise ValueError(f"Invalid shard_degree: {self.shard_degree} (expected >= 1)")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"Invalid timeout_s: {self.timeout_s} (expected seconds > 0)")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"Invalid device: {self.device!r} (expected cpu or cuda)")
        if self.device.startswith("cuda") and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError("device cuda needs a CUDA GPU and a torch build with NCCL; this one has "
                             f"{'no GPU' if not torch.cuda.is_available() else 'no NCCL'}")

    @classmethod
    def from_args(cls, argv=None, description: str = "") -> "TrainConfig":
        parser = Parser(  # errors: one line, exit code 2
            prog="experiments.train_ddp", description=description,
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
        try:
            return cls(**vars(parser.parse_args(argv)))
        except ValueError as exc:
            parser.error(str(exc))
