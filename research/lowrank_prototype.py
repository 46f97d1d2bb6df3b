"""Prototype: local steps whose pseudo-gradients travel as low-rank factors instead of DCT top-k.

Why: at H=16 the top 12 of 4,096 DCT coefficients per 64x64 chunk hold ~5% of one worker's
pseudo-gradient energy for a matrix, while its best rank-1 approximation holds 30-80%, at about
the same bytes (rank-1 factors at 4 bits). Does that turn into loss?

What it runs (the experiment runner's data, model, init, lr schedule and evaluation; 4 workers
simulated one after another in this process, each with its own AdamW, as DiLoCo):
  every H steps, per worker w and parameter:  pre = (anchor - p_w) + decay * e_w
      matrices:  the best rank-r approximation of pre (SVD), factors U sqrt(S), V sqrt(S)
                 quantized to ``bits`` bits per value with one fp32 scale per column: symmetric
                 levels -L..L, L = 2^(bits-1) - 1 (so 2 bits is ternary, {-1, 0, 1} x scale, not
                 the library's 4-level 2-bit codec; the library has no 4-bit codec)
      vectors:   pre quantized to ``bits`` bits with one fp32 scale
      e_w = pre - sent (error feedback);  anchor -= mean_w sent;  every replica restarts at anchor
  ``--mode dense`` sends every pseudo-gradient whole (fp32, no error feedback): plain periodic
  averaging, which the runner's ``distro:sync_every=H,topk=4096,bits=32`` arm also computes. This
  script reproduced that arm's losses (5.911, 5.438, 5.099 at steps 50, 100, 150, H=16).

Bytes are what the factors, scales and vectors would take on the wire (no header), per worker.
Not part of the library: the optimizer's wire format is DCT top-k only.

    python research/lowrank_prototype.py --rank 1 --bits 4 --sync-every 16 --out runs/lowrank-r1.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from distro_opt.experiments.data import load_corpus, val_batches, worker_batch
from distro_opt.experiments.model import build_model
from distro_opt.experiments.presets import get_preset
from distro_opt.experiments.train import _mean_loss, lr_factor


def quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric uniform quantization, one absmax scale per column; what the receiver reconstructs."""
    levels = 2 ** (bits - 1) - 1
    scale = x.abs().amax(dim=0, keepdim=True).clamp_min(1e-30) / levels
    return torch.round(x / scale).clamp(-levels, levels) * scale


def low_rank(pre: torch.Tensor, rank: int, bits: int) -> tuple[torch.Tensor, int]:
    """(what is sent, its bytes) for one matrix: quantized factors of the best rank-``rank`` fit."""
    u, s, vh = torch.linalg.svd(pre, full_matrices=False)
    root = s[:rank].sqrt()
    a, b = quantize(u[:, :rank] * root, bits), quantize(vh[:rank].T * root, bits)
    nbytes = math.ceil(sum(pre.shape) * rank * bits / 8) + 2 * 4 * rank
    return a @ b.T, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("lowrank", "dense"), default="lowrank")
    ap.add_argument("--sync-every", type=int, default=16, help="H: local steps per sync")
    ap.add_argument("--rank", type=int, default=1, help="rank sent per matrix")
    ap.add_argument("--embed-rank", type=int, default=None, help="rank for the token embedding (default --rank)")
    ap.add_argument("--bits", type=int, default=4, help="bits per factor value (2-8; levels -L..L, L = 2^(bits-1) - 1)")
    ap.add_argument("--decay", type=float, default=0.999, help="error-feedback decay")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--out", type=Path, required=True, help="JSON-lines output (a new file; never overwritten)")
    args = ap.parse_args()
    if args.out.exists():
        ap.error(f"{args.out} exists; choose another --out")
    if not 2 <= args.bits <= 8:
        ap.error(f"invalid --bits {args.bits} (expected 2-8)")
    for name in ("rank", "embed_rank", "sync_every", "batch_size", "steps", "eval_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"invalid --{name.replace('_', '-')} {value} (expected >= 1)")
    torch.set_num_threads(1)

    preset = dataclasses.replace(
        get_preset("smoke"), batch_size=args.batch_size, steps=args.steps, warmup_steps=args.warmup_steps
    )
    corpus = load_corpus(preset.corpus, preset.tokenizer, preset.vocab_size)
    cfg = preset.model_config(corpus.vocab_size)
    val = val_batches(corpus.val, n_batches=preset.eval_batches, batch_size=preset.eval_batch_size, seq_len=preset.seq_len)
    world = preset.workers
    models = [build_model(cfg, seed=args.seed) for _ in range(world)]
    synced = build_model(cfg, seed=args.seed)  # holds the anchor for evaluation
    opts = [
        torch.optim.AdamW(m.parameters(), lr=preset.lr, betas=(preset.beta1, preset.beta2), eps=preset.eps,
                          weight_decay=preset.weight_decay)
        for m in models
    ]
    names = [n for n, _ in synced.named_parameters()]
    anchor = [p.detach().clone() for p in synced.parameters()]
    errors = [[torch.zeros_like(a) for a in anchor] for _ in range(world)]
    numel = sum(a.numel() for a in anchor)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = args.out.open("w")
    sync_nbytes = 0

    def send(pre: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
        if args.mode == "dense":
            return pre.clone(), pre.numel() * 4
        if pre.dim() == 2:
            rank = args.embed_rank if args.embed_rank and name.startswith("embed") else args.rank
            return low_rank(pre, rank, args.bits)
        return quantize(pre.reshape(-1, 1), args.bits).reshape(pre.shape), math.ceil(pre.numel() * args.bits / 8) + 4

    def log(row: dict) -> None:
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()

    def evaluate(step: int) -> None:
        with torch.no_grad():
            for p, a in zip(synced.parameters(), anchor):
                p.copy_(a)
            log({"step": step, "val_loss": _mean_loss(synced, val, "cpu", False)})

    t0 = time.time()
    evaluate(0)
    for step in range(1, preset.steps + 1):
        factor = lr_factor(step, preset.steps, preset.warmup_steps, preset.min_lr_ratio)
        for rank, (model, opt) in enumerate(zip(models, opts)):
            for g in opt.param_groups:
                g["lr"] = preset.lr * factor
            x, y = worker_batch(corpus.train, step=step, rank=rank, world_size=world,
                                batch_size=preset.batch_size, seq_len=preset.seq_len, seed=args.seed)
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if step % args.sync_every == 0:
            with torch.no_grad():
                replicas = [list(m.parameters()) for m in models]
                sync_nbytes = 0
                for i, name in enumerate(names):
                    mean = torch.zeros_like(anchor[i])
                    for w in range(world):
                        pre = anchor[i] - replicas[w][i] + args.decay * errors[w][i]
                        sent, nbytes = send(pre, name)
                        if args.mode != "dense":
                            errors[w][i] = pre - sent
                        mean += sent / world
                    sync_nbytes += nbytes
                    anchor[i] -= mean
                for params in replicas:
                    for p, a in zip(params, anchor):
                        p.copy_(a)
        if step % args.eval_every == 0 or step == preset.steps:
            evaluate(step)
    per_step = sync_nbytes / args.sync_every
    log({"bytes_per_sync": sync_nbytes, "vs_dense_bf16": 2 * numel / per_step, "wall_s": round(time.time() - t0, 1),
         "args": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    main()
