"""DisTrOAdamW with 4 in-process workers trains a small model to within a stated tolerance of AdamW,
and keeps most of what the four workers gain over one worker training alone.

Task: a 2-hidden-layer MLP (21k parameters) learns the labels of a fixed random teacher network; each
worker sees its own stream of 32 inputs per step, 300 steps. AdamW all-reduces dense gradients
through the same backend; DisTrOAdamW exchanges its default payload (the preconditioned momentum,
top-4 of each 16x16 chunk, 1 bit); alone is AdamW on worker 0's stream with no network.
Measured when written: AdamW 0.326, DisTrOAdamW 0.368, alone 0.472 validation loss (start: ln 8 =
2.08): R = (alone - DisTrOAdamW) / (alone - AdamW) = 71%.
"""
import copy

import torch

from distro_opt import DisTrOAdamW
from distro_opt.comm import InProcessBackend

WORKERS, STEPS, LR = 4, 300, 3e-3
TOLERANCE = 1.25  # DisTrOAdamW's final loss may be at most 25% above AdamW's on this task


def inputs(rank, step, n=32):
    return torch.randn(n, 32, generator=torch.Generator().manual_seed(rank * 100003 + step))


def make_task():
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    student = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)
    )
    return teacher.requires_grad_(False), student


def train(make_opt, dense_allreduce, workers=WORKERS):
    teacher, student = make_task()
    models = [copy.deepcopy(student) for _ in range(workers)]
    x_val = inputs(999, 0, 2048)

    def loss(model, x):
        return torch.nn.functional.cross_entropy(model(x), teacher(x).argmax(1))

    def worker(backend):
        model = models[backend.rank]
        opt = make_opt(model.parameters(), backend)
        for t in range(STEPS):
            opt.zero_grad()
            loss(model, inputs(backend.rank, t)).backward()
            if dense_allreduce:
                for p in model.parameters():
                    backend.all_reduce(p.grad, op="mean")
            opt.step()
        with torch.no_grad():
            return loss(model, x_val).item(), backend.stats.bytes_sent

    return InProcessBackend.run(workers, worker, timeout_s=300)[0]


def test_distro_adamw_reaches_adamw_loss_within_tolerance_at_far_fewer_bytes_and_beats_one_worker_alone():
    adamw_loss, adamw_bytes = train(lambda ps, b: torch.optim.AdamW(ps, lr=LR), dense_allreduce=True)
    distro_loss, distro_bytes = train(lambda ps, b: DisTrOAdamW(ps, lr=LR, comm=b), dense_allreduce=False)
    assert adamw_loss < 0.3 * 2.08 and distro_loss < 0.3 * 2.08  # both learned
    assert distro_loss <= TOLERANCE * adamw_loss, (distro_loss, adamw_loss)
    assert distro_bytes * 50 < adamw_bytes
    alone_loss, alone_bytes = train(lambda ps, b: torch.optim.AdamW(ps, lr=LR), dense_allreduce=False, workers=1)
    assert alone_bytes == 0
    retained = (alone_loss - distro_loss) / (alone_loss - adamw_loss)
    assert retained >= 0.5, (alone_loss, distro_loss, adamw_loss)
