"""The optimizers on a CUDA GPU reach the CPU's parameters and state (float64), alone and with
in-process workers, and a checkpoint moves between the two devices. Skipped where torch sees no
GPU (CI has none); ``bash scripts/gpu_check.sh`` runs them on a machine that has one."""
from __future__ import annotations

import warnings

import pytest
import torch

from distro_opt import DeMo, DisTrOAdamW
from distro_opt.comm import InProcessBackend

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here"),
]

# a matrix, a vector, a 3-D tensor and a conv kernel; chunk 8 so every tensor has several chunks
SHAPES = [(64, 96), (96,), (8, 16, 24), (6, 4, 3, 3)]
COMPRESSION = dict(lr=1e-2, compression_chunk=8, compression_topk=4)
# The sign update is tested with float values: a 1-bit payload gives all kept coefficients of a
# chunk one magnitude, so with one worker the inverse DCT cancels exactly at some elements and the
# sign there is rounding noise (on an H200, 4 of 6144 elements flipped). Each value codec is still
# run, under an update without a sign.
ARMS = {
    "distro-sign-fp32": (DisTrOAdamW, dict(COMPRESSION, compression_bits=32)),
    "distro-adam-1bit": (DisTrOAdamW, dict(COMPRESSION, compression_bits=1, update="adam")),
    "distro-rms-2bit": (DisTrOAdamW, dict(COMPRESSION, compression_bits=2, update="rms")),
    "distro-adam-8bit": (DisTrOAdamW, dict(COMPRESSION, compression_bits=8, update="adam")),
    "demo": (DeMo, dict(COMPRESSION, weight_decay=0.1)),
}
STEPS = 5


def data(world_size: int):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    grads = [[[torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
              for _ in range(world_size)] for _ in range(STEPS)]
    return init, grads


def steps(opt, params, grads, rank, start, stop):
    for t in range(start, stop):
        for p, g in zip(params, grads[t][rank]):
            p.grad = g.to(p.device)
        opt.step()


def train(arm: str, device: str, world_size: int = 1):
    """Parameters and optimizer state (on the CPU) of each worker after STEPS steps on ``device``."""
    cls, kwargs = ARMS[arm]
    init, grads = data(world_size)

    def worker(backend):
        params = [torch.nn.Parameter(t.to(device, copy=True)) for t in init]
        opt = cls(params, comm=backend, **kwargs)
        steps(opt, params, grads, backend.rank, 0, STEPS)
        state = [{k: v.cpu() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in params]
        return [p.detach().cpu() for p in params], state

    return InProcessBackend.run(world_size, worker, timeout_s=120)


def assert_close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("arm", sorted(ARMS))
def test_cuda_reaches_the_cpu_parameters_and_state(arm, world_size):
    on_cpu, on_gpu = train(arm, "cpu", world_size), train(arm, "cuda", world_size)
    for (params_c, state_c), (params_g, state_g) in zip(on_cpu, on_gpu):
        assert_close(params_g, params_c)
        assert [sorted(s) for s in state_g] == [sorted(s) for s in state_c]
        for sg, sc in zip(state_g, state_c):
            for key in sc:
                assert_close(sg[key], sc[key])
    # the run moved the parameters, so agreeing is not the trivial agreement of two no-ops
    init, _ = data(world_size)
    assert not torch.allclose(on_cpu[0][0][0], init[0])


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_checkpoint_moves_from_gpu_to_cpu_and_back(arm):
    cls, kwargs = ARMS[arm]
    init, grads = data(1)

    def fresh(device, start):
        params = [torch.nn.Parameter(t.to(device, copy=True)) for t in start]
        return params, cls(params, **kwargs)

    def on_cpu(params):
        return [p.detach().cpu() for p in params]

    straight_params, straight = fresh("cuda", init)
    steps(straight, straight_params, grads, 0, 0, STEPS)

    gpu_params, gpu_opt = fresh("cuda", init)
    steps(gpu_opt, gpu_params, grads, 0, 0, 2)
    cpu_params, cpu_opt = fresh("cpu", on_cpu(gpu_params))
    cpu_opt.load_state_dict(gpu_opt.state_dict())
    assert all(v.device.type == "cpu" for s in cpu_opt.state.values() for v in s.values() if torch.is_tensor(v)
               and v.dim() > 0)
    steps(cpu_opt, cpu_params, grads, 0, 2, 4)

    back_params, back_opt = fresh("cuda", on_cpu(cpu_params))
    back_opt.load_state_dict(cpu_opt.state_dict())
    steps(back_opt, back_params, grads, 0, 4, STEPS)
    assert_close(on_cpu(back_params), on_cpu(straight_params))


def test_non_finite_gradient_on_the_gpu_is_caught_and_poisons_no_one():
    init, grads = data(2)

    def worker(backend):
        params = [torch.nn.Parameter(t.to("cuda", copy=True)) for t in init]
        opt = DisTrOAdamW(params, comm=backend, **COMPRESSION)
        for t in range(3):
            for p, g in zip(params, grads[t][backend.rank]):
                p.grad = g.to(p.device)
            if backend.rank == 1 and t == 1:
                params[0].grad[3, 5] = float("nan")
            opt.step()
        return [p.detach().cpu() for p in params], [opt.state[p]["delta"].cpu() for p in params]

    with warnings.catch_warnings(record=True) as caught:  # process-wide: recorded around the threads
        warnings.simplefilter("always")
        results = InProcessBackend.run(2, worker, timeout_s=120)
    assert sum("non-finite local gradient" in str(w.message) for w in caught) == 1
    for params, deltas in results:
        assert all(torch.isfinite(t).all() for t in params + deltas)
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
