"""Experiment presets: plain dataclasses. Every field can be overridden from the command line.

* ``smoke``: ~1.1M parameters, 4 workers x 4 sequences x 128 tokens, 300 steps; the CI run
  (both arms together in under 3 minutes on 2 CPU cores).
* ``parity``: the same model for 3000 steps and two paired seeds: the loss-parity measurement.
* ``volunteer``: smoke's model, steps and 2,048-token global batch spread over 16 workers of one
  128-token sequence each: the volunteer case, many machines with small batches each. The worker
  count is a study axis at the same global batch: ``--workers 8 --batch-size 2`` and
  ``--workers 4 --batch-size 4`` (smoke); 32 workers need ``--seq-len 64``.
* ``llama-1.2b``: the DisTrO report's model and hyperparameters (16 layers, hidden 2048, FFN 8192,
  8 heads, vocab 32000, context 2048; AdamW betas (0.9, 0.95), peak lr 4e-4 cosine to 4e-5, 400
  warm-up steps, weight decay 0.1), bf16 autocast and activation checkpointing, for torchrun on GPUs,
  each node of 8 sharding one replica (shard_degree 8).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

from .data import check_sharding
from .model import ModelConfig

MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed
# Far above any machine's cores, far below where thread creation fails (16384 on a 2-core test box;
# 100000 segfaults inside torch).
MAX_TORCH_THREADS = 1024


@dataclass
class Preset:
    name: str = "smoke"
    # model
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 384
    seq_len: int = 128
    tie_embeddings: bool = True
    activation_checkpointing: bool = False
    # data
    corpus: str = "shakespeare"
    tokenizer: str = "bpe"
    vocab_size: int = 2048
    # "contiguous": worker i trains on its own i-th slice of the text; "iid": all draw from all of it
    sharding: str = "contiguous"
    # training (per arm)
    arms: str = "adamw,distro"
    workers: int = 4
    batch_size: int = 4  # sequences per worker per step
    steps: int = 300
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    warmup_steps: int = 30
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # clip the gradient each optimizer steps on to this global norm (0: off): the averaged one for
    # AdamW and powersgd, each worker's own before it is compressed for distro, demo and demo-peer
    grad_clip: float = 0.0
    seeds: str = "0"  # comma-separated; each arm runs once per seed from that seed's initialization
    # "lr=0.5x,1x,2x,4x" (and ";outer_lr=..."): every arm at every point, compared best vs best
    # (experiments.sweep); "" runs each arm once as written
    sweep: str = ""
    # measurement
    eval_every: int = 50
    eval_batches: int = 4  # x eval_batch_size x seq_len = 8K fixed validation tokens (smoke)
    eval_batch_size: int = 16
    checkpoint_every: int = 100
    # execution
    device: str = "cpu"
    autocast: str = "none"  # "none" or "bf16"
    # intra-op threads per process: 1 suits several in-process workers on a CPU; 0 = torch's default
    torch_threads: int = 1
    timeout_s: float = 300.0  # bound on every collective wait
    # torchrun only: ranks per replica, the model sharded over them with FSDP2 (experiments/hybrid.py)
    shard_degree: int = 1

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        return ModelConfig(
            vocab_size=vocab_size or self.vocab_size,
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            max_seq_len=self.seq_len,
            tie_embeddings=self.tie_embeddings,
            activation_checkpointing=self.activation_checkpointing,
        )

    def seed_list(self) -> list[int]:
        try:
            seeds = [int(s) for s in self.seeds.split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"Invalid seeds: {self.seeds!r} (expected comma-separated integers)") from None
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError(f"Invalid seeds: {self.seeds!r} (expected distinct integers)")
        if not all(0 <= s <= MAX_SEED for s in seeds):  # numpy's generators take no negative seed
            raise ValueError(f"Invalid seeds: {self.seeds!r} (expected integers from 0 to 2**63 - 1)")
        return seeds

    def validate(self) -> None:
        positive = (
            "n_layers",
            "d_model",
            "n_heads",
            "d_ff",
            "seq_len",
            "workers",
            "batch_size",
            "steps",
            "eval_every",
            "eval_batches",
            "eval_batch_size",
            "checkpoint_every",
            "shard_degree",
        )
        for name in positive:
            if not getattr(self, name) >= 1:
                raise ValueError(f"Invalid {name}: {getattr(self, name)!r} (expected >= 1)")
        if not 0.0 < self.lr < float("inf"):
            raise ValueError(f"Invalid learning rate: {self.lr}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"Invalid warmup_steps: {self.warmup_steps} (expected 0 <= warmup_steps < steps)"
            )
        if not 0.0 <= self.grad_clip < float("inf"):
            raise ValueError(f"Invalid grad_clip: {self.grad_clip} (expected 0 (off) or a positive norm)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"Invalid min_lr_ratio: {self.min_lr_ratio}")
        check_sharding(self.sharding)
        if self.autocast not in ("none", "bf16"):
            raise ValueError(f"Invalid autocast: {self.autocast!r} (expected 'none' or 'bf16')")
        self._check_device()
        if not 0 <= self.torch_threads <= MAX_TORCH_THREADS:
            raise ValueError(
                f"Invalid torch_threads: {self.torch_threads} (expected 0, torch's default, "
                f"to {MAX_TORCH_THREADS})"
            )
        if not 0.0 < self.timeout_s <= threading.TIMEOUT_MAX:  # beyond it, waits raise OverflowError
            raise ValueError(
                f"Invalid timeout_s: {self.timeout_s} (expected > 0 and <= {threading.TIMEOUT_MAX:.0f})"
            )
        self.seed_list()
        self.model_config()  # validates the model shape

    def _check_device(self) -> None:
        """Only cpu and cuda run the model: anything else would fail inside the workers, after the run
        directory was written."""
        try:
            device = torch.device(self.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"Invalid device {self.device!r} (expected cpu, cuda or cuda:N)")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"Invalid device {self.device!r}: CUDA is not available here (pass --device cpu)"
            )
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"Invalid device {self.device!r}: this machine has {torch.cuda.device_count()} CUDA devices"
            )


SMOKE = Preset()

PARITY = dataclasses.replace(
    SMOKE,
    name="parity",
    steps=3000,
    warmup_steps=100,
    seeds="0,1",
    eval_every=100,
    eval_batches=16,
    checkpoint_every=250,
)

VOLUNTEER = dataclasses.replace(SMOKE, name="volunteer", workers=16, batch_size=1)

LLAMA_1_2B = Preset(
    name="llama-1.2b",
    n_layers=16,
    d_model=2048,
    n_heads=8,
    d_ff=8192,
    seq_len=2048,
    tie_embeddings=False,
    activation_checkpointing=True,
    vocab_size=32000,
    workers=32,
    batch_size=64,
    steps=25000,
    lr=4e-4,
    min_lr_ratio=0.1,
    warmup_steps=400,
    beta1=0.9,
    beta2=0.95,
    weight_decay=0.1,
    eval_every=500,
    eval_batches=16,
    eval_batch_size=8,
    checkpoint_every=500,
    device="cuda",
    autocast="bf16",
    torch_threads=0,
    timeout_s=1800.0,
    shard_degree=8,  # one node of 8 GPUs holds one replica; distro-opt runs between the nodes
)

PRESETS = {p.name: p for p in (SMOKE, PARITY, VOLUNTEER, LLAMA_1_2B)}


def saved_preset_fields(saved: dict) -> dict:
    """The preset fields of a run's config.json, with fields added since it was written set to their
    defaults (what such a run used), so old and new runs of the same settings compare equal."""
    return {**dataclasses.asdict(Preset()), **saved}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r} (expected one of {', '.join(PRESETS)})")
    return dataclasses.replace(PRESETS[name])
