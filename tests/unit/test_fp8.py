"""A model converted to FP8 training with torchao (``convert_to_float8_training``) trains with
DisTrOAdamW unchanged, here with torchao's emulation on the CPU (``Float8LinearConfig(emulate=True)``).

FP8 changes the matrix products of the forward and backward passes, not what the optimizer sees:
the weights stay high-precision parameters and their gradients high-precision tensors, so the
payload (its layout and its bytes) is the unconverted model's, and only the gradients' values
differ by FP8's rounding.
"""
from __future__ import annotations

import warnings

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from distro_opt import DisTrOAdamW
from distro_opt.comm import InProcessBackend


def _model(fp8: bool, init: dict) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    model.load_state_dict(init)  # one start for every worker (they are threads: no seeding in them)
    if fp8:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    return model


def _train(fp8: bool, world_size: int = 2, steps: int = 30):
    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128)).state_dict()
    teacher = torch.nn.Linear(128, 128)
    torch.nn.init.orthogonal_(teacher.weight, generator=torch.Generator().manual_seed(1))

    def worker(backend):
        model = _model(fp8, init)
        opt = DisTrOAdamW(model.parameters(), lr=1e-2, comm=backend, compression_topk=64)
        losses = []
        for t in range(steps):
            g = torch.Generator().manual_seed(1000 * t + backend.rank)
            x = torch.randn(32, 128, generator=g)
            with torch.no_grad():
                y = torch.tanh(teacher(x))
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        kinds = {(type(p).__name__, p.dtype, p.grad.dtype) for p in model.parameters()}
        return losses, opt.payload_nbytes, opt.comm.stats.bytes_sent, kinds, [p.detach().clone() for p in model.parameters()]

    return InProcessBackend.run(world_size, worker, timeout_s=120)


def test_an_fp8_model_trains_with_the_same_payload_as_the_high_precision_one():
    fp8, plain = _train(fp8=True), _train(fp8=False)
    assert fp8[0][3] == {("Parameter", torch.float32, torch.float32)}  # what the optimizer sees
    assert fp8[0][1] == plain[0][1] and fp8[0][2] == plain[0][2]  # payload size and bytes sent
    losses = fp8[0][0]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5  # it learns
    plain_losses = plain[0][0]
    assert abs(sum(losses[-5:]) - sum(plain_losses[-5:])) / sum(plain_losses[-5:]) < 0.1  # as the other does
    assert all(torch.equal(a, b) for a, b in zip(fp8[0][4], fp8[1][4]))  # replicas identical
    assert not all(torch.equal(a, b) for a, b in zip(fp8[0][4], plain[0][4]))  # FP8 did change the gradients
