"""Every kind of tensor a model can hand the optimizer takes a step or gets one clear error.

Layouts the fast paths do not read in place (strided, transposed, expanded, channels-last) must
train exactly like their contiguous twins; half-precision parameters train with float32 momentum;
what no step can compute on (meta-device parameters, sparse gradients, complex parameters) is
refused, naming the problem, before anything changes. DTensor (FSDP2) parameters: see
test_torch_dist_fsdp.py; the native kernel's own refusals: test_native.py.
"""
from __future__ import annotations

import pytest
import torch

from distro_opt import DeMo, DisTrOAdamW

OPTIMIZERS = [DisTrOAdamW, DeMo]


def _steps(cls, param, grads):
    opt = cls([param], lr=0.01)
    for g in grads:
        param.grad = g
        opt.step()
    return param.detach().clone(), opt


def _grads(shape, n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


LAYOUTS = {
    "strided parameter": (lambda: torch.randn(128, 256)[:, ::2], lambda g: g),
    "transposed parameter": (lambda: torch.randn(128, 64).t(), lambda g: g),
    "transposed gradient": (lambda: torch.randn(128, 128), lambda g: g.t().contiguous().t()),
    "strided gradient": (lambda: torch.randn(128, 128), lambda g: torch.stack([g, g], 2)[:, :, 0]),
    "expanded gradient": (lambda: torch.randn(128, 128), lambda g: g[:1].expand(128, 128)),
    "channels-last": (lambda: torch.randn(64, 64, 3, 3).to(memory_format=torch.channels_last),
                      lambda g: g.contiguous(memory_format=torch.channels_last)),
}


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_a_layout_the_fast_paths_do_not_read_in_place_trains_like_its_contiguous_twin(cls, kind):
    make, lay_out = LAYOUTS[kind]
    torch.manual_seed(0)
    start = make()
    grads = _grads(start.shape)
    odd, _ = _steps(cls, torch.nn.Parameter(start.clone(memory_format=torch.preserve_format)),
                    [lay_out(g) for g in grads])
    plain, _ = _steps(cls, torch.nn.Parameter(start.contiguous().clone()), [lay_out(g).contiguous() for g in grads])
    assert not torch.equal(plain, start.contiguous())  # it trained
    assert torch.equal(odd, plain)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_train_with_float32_momentum(cls, dtype):
    start = torch.randn(128, 128).to(dtype)
    param = torch.nn.Parameter(start.clone())
    after, opt = _steps(cls, param, [g.to(dtype) for g in _grads(param.shape)])
    assert after.dtype == dtype and bool(torch.isfinite(after.float()).all())
    assert not torch.equal(after, start)
    assert opt.state[param]["delta"].dtype == torch.float32


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_meta_parameter_is_refused_at_the_step_naming_the_device(cls):
    param = torch.nn.Parameter(torch.empty(64, 64, device="meta"))
    opt = cls([param], lr=0.01)
    param.grad = torch.empty(64, 64, device="meta")
    with pytest.raises(ValueError, match="on the meta device: materialize the model first"):
        opt.step()
    assert len(opt.state) == 0


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_sparse_gradient_is_refused_before_anything_changes(cls):
    param = torch.nn.Parameter(torch.randn(64, 64))
    start = param.detach().clone()
    opt = cls([param], lr=0.01)
    param.grad = torch.randn(64, 64).to_sparse()
    with pytest.raises(ValueError, match="is torch.sparse_coo: distro-opt takes dense gradients"):
        opt.step()
    assert torch.equal(param.detach(), start) and len(opt.state) == 0


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_complex_parameters_are_refused_at_construction_and_by_add_param_group(cls):
    complex_param = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"complex parameters are not supported \(shapes \[\(8, 8\)\]\)"):
        cls([complex_param], lr=0.01)
    opt = cls([torch.nn.Parameter(torch.randn(8, 8))], lr=0.01)
    with pytest.raises(ValueError, match="complex parameters are not supported"):
        opt.add_param_group({"params": [complex_param]})
    assert len(opt.param_groups) == 1
