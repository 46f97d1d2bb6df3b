"""How much would a fused kernel (torch.compile) save in DisTrOAdamW's step? A prototype, not shipped.

The update is the one elementwise part of a DisTrOAdamW step left as several passes over the model:
the sparse inverse DCT of the aggregate (one batched GEMM with inner size k per chunk), its sign,
weight decay and the step. (The momentum update ``Delta = decay * Delta + DCT(g)`` has no pass of
its own: it is the beta of the first-axis DCT GEMM.)

This times the update over the transformer shapes of ``bench_step.py``, eager against
``torch.compile`` (static shapes: one compiled kernel per shape), next to the whole eager steps of
AdamW and DisTrOAdamW, in interleaved rounds. The first call compiles (tens of seconds; Inductor
needs a C++ compiler). Random aggregates stand in for decoded ones: only the time is of interest.

    python benchmarks/fused_prototype.py [--threads 1] [--rounds 3] [--steps 20]
"""
from __future__ import annotations

import statistics
import time

import torch

from bench_step import timing_setup, transformer_shapes
from distro_opt import DCTTransform, DisTrOAdamW
from distro_opt.transform import dct_matrix

TOPK = 4  # coefficients per chunk in the aggregate: one worker's top-4


def update_eager(transform, p, idx, values, chunk, lr, shrink):
    """As DisTrOAdamW does it: the transform's sparse inverse into its workspace, then decay, sign, step."""
    (direction,) = transform.decode_many(idx, values, chunk, [(0, idx.shape[0], tuple(p.shape))])
    p.mul_(shrink)
    p.view(direction.shape).add_(direction.sign_(), alpha=-lr)


def update_fusable(p, idx, values, basis0, basis1, lr: float, shrink: float):
    """The same arithmetic written for a compiler: one expression per output element."""
    c0, c1 = basis0.shape[0], basis1.shape[0]
    first, last = basis0[idx // c1], basis1[idx % c1] * values.unsqueeze(-1)  # (chunks, k, c)
    y = (first.unsqueeze(3) * last.unsqueeze(2)).sum(1)  # (chunks, c0, c1)
    direction = y.view(p.shape[0] // c0, p.shape[1] // c1, c0, c1).permute(0, 2, 1, 3).reshape(p.shape)
    p.mul_(shrink).add_(torch.sign(direction), alpha=-lr)


def main(argv=None):
    args = timing_setup(__doc__.splitlines()[0], argv, threads=1, rounds=3)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in transformer_shapes()]
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-3
    transform = DCTTransform()
    work = []  # the 2-D parameters (all but the norm gains, which are 0.02% of the elements)
    for p in params:
        chunk = transform.chunk_shape(tuple(p.shape), 64)
        if len(chunk) == 2:
            chunks, numel = p.numel() // (chunk[0] * chunk[1]), chunk[0] * chunk[1]
            aggregate = (torch.randint(numel, (chunks, TOPK)), torch.randn(chunks, TOPK))
            work.append((p.detach(), chunk, aggregate, (dct_matrix(chunk[0]), dct_matrix(chunk[1]))))
    update_compiled = torch.compile(update_fusable, dynamic=False)
    start = time.perf_counter()
    for p, _, (idx, values), bases in work:
        update_compiled(p, idx, values, *bases, 1e-3, 0.99999)
    print(f"compile (or compile-cache load): {time.perf_counter() - start:.0f} s")

    adamw, distro = torch.optim.AdamW(params, foreach=True), DisTrOAdamW(params)
    arms = {
        "AdamW step (foreach)": adamw.step,
        "DisTrOAdamW step (eager)": distro.step,
        "update, eager": lambda: [update_eager(transform, p, *agg, c, 1e-3, 0.99999) for p, c, agg, _ in work],
        "update, compiled": lambda: [update_compiled(p, *agg, *b, 1e-3, 0.99999) for p, _, agg, b in work],
    }
    times = {name: [] for name in arms}
    for fn in arms.values():
        fn()  # warm-up
    for _ in range(args.rounds):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    print(f"\n{torch.get_num_threads()} threads, torch {torch.__version__}, median of {args.rounds} rounds\n")
    print("| what | ms |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.1f} |")


if __name__ == "__main__":
    main()
