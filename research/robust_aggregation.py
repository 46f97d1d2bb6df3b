"""How far rogue contributors steer DisTrO-AdamW, with DeMo's aggregate, with the trimmed mean
(``distro_opt/robust.py``) and with a clipped mean over all contributors (the alternative, defined
here), and what each costs in loss with no rogue.

N in-process workers (``InProcessBackend``) train a 16-64-4 tanh classifier on their own seeded
batches with the volunteer program's compression (top-8 of 64-coefficient chunks, 8-bit values).
Ranks 0 .. R-1 are rogues; each step a rogue replaces its gradient by one of:

* ``dc``: 1e30 * ones: its energy lands on every chunk's DC coefficient, which no honest worker
  selects, and travels at a scale far beyond any honest one (valid 8-bit payloads);
* ``flip``: its honest gradient, sign-flipped and scaled to norm 1e30 (the honest support, reversed).

On the last (honest) rank: *rogue-way* = the share of parameter entries whose update has the sign
the rogue's gradient asks for, averaged over the steps (about 0.5 by chance); *flipped* = the share
of the first update's entries (same start, no momentum yet) whose sign differs from the all-honest
run's; and the held-out loss after the run, all-honest and attacked (same aggregate).

    .venv/bin/python research/robust_aggregation.py
"""

from __future__ import annotations

import contextlib

import torch

from distro_opt import DisTrOAdamW, step
from distro_opt.comm import InProcessBackend

STEPS, LOSS_STEPS, LR, ROGUE_NORM = 20, 200, 1e-2, 1e30


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def data(step: int, rank: int):
    """A fixed teacher's labels on rank- and step-seeded inputs: learnable, different per worker."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, 16, generator=g)
    teacher = torch.Generator().manual_seed(12345)
    return x, (x @ torch.randn(16, 4, generator=teacher)).argmax(1)


def clipped_mean_aggregate(seg, contributions, like, untrusted_fraction, to_device):
    """The alternative measured beside the trimmed mean: every contributor's chunk clipped to twice the
    contributors' median chunk norm, then the mean over all N (a contributor without a coefficient
    counting as 0). Research only: its bound is a share of the norm, not the honest range."""
    dense = torch.zeros(len(contributions), seg.num_chunks, seg.chunk_numel, dtype=like.dtype)
    for row, (i, v) in zip(dense, contributions):
        row.scatter_(1, i, v.to(like.dtype))
    norms = dense.double().norm(dim=2, keepdim=True)  # float64: a rogue's float32 norm would be inf
    dense = dense * (2 * norms.median(dim=0).values / norms.clamp_min(1e-300)).clamp(max=1).to(like.dtype)
    idx = torch.cat([i for i, _ in contributions], dim=1)
    count = torch.zeros_like(dense[0]).scatter_add_(1, idx, torch.ones(idx.shape, dtype=like.dtype))
    return idx, dense.mean(0).gather(1, idx) / count.gather(1, idx)


@contextlib.contextmanager
def aggregate_rule(name: str):
    """``untrusted_fraction > 0`` runs ``step.trimmed_mean_aggregate``; "clipped" swaps in the alternative."""
    trimmed = step.trimmed_mean_aggregate
    if name == "clipped":
        step.trimmed_mean_aggregate = clipped_mean_aggregate
    try:
        yield
    finally:
        step.trimmed_mean_aggregate = trimmed


def rogue_gradient(kind: str, honest: torch.Tensor) -> torch.Tensor:
    if kind == "dc":
        return torch.full_like(honest, ROGUE_NORM)
    return -honest * (ROGUE_NORM / honest.norm().clamp_min(1e-30))


def train(n: int, rogues: int, kind: str, untrusted_fraction: float, steps: int):
    """Every rank's run; returns the last rank's (parameter vector per step, gradient per step of rank 0)."""

    torch.manual_seed(0)
    start = model().state_dict()  # built once: torch's global seed is shared by the worker threads

    def worker(backend):
        backend.untrusted_fraction = untrusted_fraction
        net = model()
        net.load_state_dict(start)
        opt = DisTrOAdamW(net.parameters(), lr=LR, compression_topk=8, compression_chunk=64,
                          compression_bits=8, comm=backend)
        trail, pushes, losses = [torch.nn.utils.parameters_to_vector(net.parameters()).clone()], [], []
        for t in range(steps):
            x, y = data(t, backend.rank)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            if backend.rank < rogues:
                for p in net.parameters():
                    p.grad = rogue_gradient(kind, p.grad)
            pushes.append(-torch.cat([p.grad.flatten() for p in net.parameters()]))
            opt.step()
            trail.append(torch.nn.utils.parameters_to_vector(net.parameters()).clone())
            losses.append(held_out_loss(net))
        return trail, pushes, losses

    results = InProcessBackend.run(n, worker)
    return results[-1][0], results[0][1], results[-1][2]


@torch.no_grad()
def held_out_loss(net) -> float:
    x, y = data(10**6, 0)
    return torch.nn.functional.cross_entropy(net(x), y).item()


def steering(n: int, rogues: int, kind: str, untrusted_fraction: float) -> tuple[float, float, float, float]:
    honest, _, honest_losses = train(n, 0, kind, untrusted_fraction, STEPS)
    attacked, pushes, losses = train(n, rogues, kind, untrusted_fraction, STEPS)
    way = sum(
        (torch.sign(attacked[t + 1] - attacked[t]) == torch.sign(pushes[t])).float().mean().item()
        for t in range(STEPS)
    ) / STEPS
    flipped = (torch.sign(attacked[1] - attacked[0]) != torch.sign(honest[1] - honest[0])).float().mean().item()
    return way, flipped, honest_losses[-1], losses[-1]


RULES = (("DeMo mean", 0.0, "trimmed"), ("trimmed 0.25", 0.25, "trimmed"), ("clipped mean", 0.25, "clipped"))


def main() -> None:
    print(f"N | rogues | rogue | aggregate | rogue-way | flipped at step 1 | loss at {STEPS}: honest, attacked")
    for n, rogues in ((4, 1), (8, 1), (8, 2)):
        for kind in ("dc", "flip"):
            for name, fraction, rule in RULES:
                with aggregate_rule(rule):
                    way, flipped, honest_loss, loss = steering(n, rogues, kind, fraction)
                print(f"{n} | {rogues} | {kind} | {name} | {way:.3f} | {flipped:.3f} | {honest_loss:.3f}, {loss:.3g}",
                      flush=True)
    print(f"\nno rogue, held-out loss after {LOSS_STEPS} steps (mean of the last 20)")
    print("N | " + " | ".join(name for name, _, _ in RULES))
    for n in (4, 8):
        row = []
        for _, fraction, rule in RULES:
            with aggregate_rule(rule):
                row.append(sum(train(n, 0, "dc", fraction, LOSS_STEPS)[2][-20:]) / 20)
        print(f"{n} | " + " | ".join(f"{x:.4f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
