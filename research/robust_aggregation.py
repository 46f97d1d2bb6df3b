"""How far rogue contributors steer DisTrO-AdamW, with DeMo's aggregate and with the trimmed mean
(``distro_opt/robust.py``), and what the trimmed mean costs in loss with no rogue.

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

import torch

from distro_opt import DisTrOAdamW
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


def main() -> None:
    print(f"N | rogues | rogue | aggregate | rogue-way | flipped at step 1 | loss at {STEPS}: honest, attacked")
    for n, rogues in ((4, 1), (8, 1), (8, 2)):
        for kind in ("dc", "flip"):
            for name, fraction in (("DeMo mean", 0.0), ("trimmed 0.25", 0.25)):
                way, flipped, honest_loss, loss = steering(n, rogues, kind, fraction)
                print(f"{n} | {rogues} | {kind} | {name} | {way:.3f} | {flipped:.3f} | {honest_loss:.3f}, {loss:.3g}",
                      flush=True)
    print(f"\nno rogue, held-out loss after {LOSS_STEPS} steps (mean of the last 20)")
    print("N | DeMo mean | trimmed 0.25")
    for n in (4, 8):
        row = [sum(train(n, 0, "dc", f, LOSS_STEPS)[2][-20:]) / 20 for f in (0.0, 0.25)]
        print(f"{n} | {row[0]:.4f} | {row[1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
