"""Overlap mode applies each update one step late; GradScaler never desynchronizes workers."""
import warnings

import pytest
import torch

from distro_opt import DeMo, DisTrOAdamW
from distro_opt.comm import InProcessBackend


def fixed_grads(step, shapes):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g) for s in shapes]


def run_fixed(overlap, steps, lr="constant"):
    """DeMo on fixed gradients; ``lr``: "constant", "schedule" (halved every step, with weight decay)
    or "tensor schedule" (the same, the lr a tensor, which schedulers update in place)."""
    shapes = [(64, 48), (48,)]
    params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
    opt = DeMo(params, lr=torch.tensor(0.01) if lr == "tensor schedule" else 0.01, overlap=overlap,
               weight_decay=0.0 if lr == "constant" else 0.5)
    schedule = None if lr == "constant" else torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    history = []
    for t in range(steps):
        for p, g in zip(params, fixed_grads(t, shapes)):
            p.grad = g
        opt.step()
        if schedule is not None:
            schedule.step()
        history.append([p.detach().clone() for p in params])
    opt.flush()
    return history, [p.detach().clone() for p in params]


# with a schedule, step t's update lands at step t + 1 with step t's lr and weight decay, as blocking
@pytest.mark.parametrize("lr", ["constant", "schedule", "tensor schedule"])
def test_overlap_applies_each_update_one_step_late(lr):
    blocking, _ = run_fixed(False, 4, lr)
    overlapped, final = run_fixed(True, 4, lr)
    assert all(torch.equal(p, torch.ones_like(p)) for p in overlapped[0])  # step 0's update still travels
    for t in range(1, 4):
        assert all(torch.equal(a, b) for a, b in zip(overlapped[t], blocking[t - 1]))
    assert all(torch.equal(a, b) for a, b in zip(final, blocking[3]))  # flush lands the last one


def test_overlap_workers_stay_identical():
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 2) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())

    def worker(backend):
        model = models[backend.rank]
        opt = DisTrOAdamW(model.parameters(), lr=0.01, comm=backend, overlap=True)
        for t in range(5):
            opt.zero_grad()
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * t + backend.rank))).sum().backward()
            opt.step()
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    results = InProcessBackend.run(3, worker, timeout_s=60)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))


def test_grad_scaler_step_with_inf_on_one_worker_completes_everywhere():
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 2) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())

    def worker(backend):
        model = models[backend.rank]
        opt = DisTrOAdamW(model.parameters(), lr=0.01, comm=backend)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for t in range(3):
            opt.zero_grad()
            loss = model(torch.ones(4, 8) * (t + 1)).sum()
            scaler.scale(loss).backward()
            if backend.rank == 1 and t == 1:
                model.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        return [p.detach().clone() for p in model.parameters()], scaler.get_scale(), backend.stats.steps

    with warnings.catch_warnings(record=True) as caught:  # process-wide: record around all threads
        warnings.simplefilter("always")
        (p0, scale0, steps0), (p1, scale1, steps1) = InProcessBackend.run(2, worker, timeout_s=60)
    assert sum("GradScaler found inf" in str(w.message) for w in caught) == 1
    assert steps0 == steps1 == 3 + 1  # every worker took part in every collective (and the replica check)
    assert all(torch.equal(a, b) and torch.isfinite(a).all() for a, b in zip(p0, p1))
    assert scale1 < scale0  # only the worker that saw inf backed off its scale

