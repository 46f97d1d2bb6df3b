"""precondition="adam" (each worker's gradient divided by its own second moment's root before the
error feedback) and update="linear" (p -= lr * U), held to plain references written here."""
import math
import warnings

import pytest
import torch

from distro_opt import DisTrOAdamW
from distro_opt.comm import InProcessBackend, SingleWorkerBackend

from _models import batch, make_model

B2, EPS = 0.95, 1e-8


def _grads(model, t, rank=0):
    model.zero_grad()
    x, y = batch(t, rank)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _opt(model, **kw):
    with warnings.catch_warnings():  # one worker that compresses: the optimizer says so, once
        warnings.simplefilter("ignore")
        kw.setdefault("compression_chunk", 16)  # the same chunks with and without the preconditioner
        return DisTrOAdamW(model.parameters(), lr=0.01, betas=(0.9, B2), eps=EPS, comm=SingleWorkerBackend(), **kw)


def _step(opt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()


@pytest.mark.parametrize("update", ["linear", "sign"])
def test_adam_preconditioning_is_the_plain_step_fed_g_over_the_root_of_its_second_moment(update):
    """The same optimizer without preconditioning, fed g / (sqrt(v / (1 - b2^t)) + eps) computed here."""
    ours, plain = make_model(), make_model()
    plain.load_state_dict(ours.state_dict())
    opt_ours = _opt(ours, precondition="adam", update=update)
    opt_plain = _opt(plain, precondition="none", update=update)
    vs = [torch.zeros_like(p) for p in plain.parameters()]
    for t in range(1, 7):
        grads = _grads(ours, t)
        _step(opt_ours)
        for p, g, v in zip(plain.parameters(), grads, vs):
            v.mul_(B2).add_((1 - B2) * g * g)
            p.grad = g / ((v / (1 - B2**t)).sqrt() + EPS)
        _step(opt_plain)
        for a, b in zip(ours.parameters(), plain.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(ours.parameters(), make_model().parameters()))


def test_linear_update_with_nothing_compressed_is_sgd_with_decoupled_weight_decay():
    model = make_model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = _opt(model, precondition="none", update="linear", compression_topk=64 * 64, compression_chunk=64,
               compression_bits=32, compression_decay=0.0, weight_decay=0.1)
    grads = _grads(model, 0)
    _step(opt)
    for p, p0, g in zip(model.parameters(), start, grads):
        torch.testing.assert_close(p.detach(), p0 * (1 - 0.01 * 0.1) - 0.01 * g, rtol=1e-5, atol=1e-6)


def test_the_moments_resume_exactly_from_a_checkpoint():
    straight, resumed = make_model(), make_model()
    resumed.load_state_dict(straight.state_dict())
    opt = _opt(straight, precondition="adam", update="linear")
    for t in range(6):
        _grads(straight, t)
        _step(opt)
    first = _opt(resumed, precondition="adam", update="linear")
    for t in range(3):
        _grads(resumed, t)
        _step(first)
    saved = first.state_dict()
    assert all(st["input_step"] == 3 for st in saved["state"].values())
    second = _opt(resumed, precondition="adam", update="linear")
    second.load_state_dict(saved)
    for t in range(3, 6):
        _grads(resumed, t)
        _step(second)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


def test_a_worker_with_a_nan_gradient_keeps_its_moments_and_poisons_no_one():
    models = [make_model() for _ in range(3)]

    def worker(backend):
        model = models[backend.rank]
        opt = DisTrOAdamW(model.parameters(), lr=0.01, comm=backend, precondition="adam", update="linear")
        counts = []
        for t in range(4):
            _grads(model, t, backend.rank)
            if backend.rank == 1 and t == 2:
                next(model.parameters()).grad[0, 0] = float("nan")
            opt.step()
            counts.append(float(opt.state[next(model.parameters())]["input_step"]))
        moments = [opt.state[p]["input_exp_avg_sq"] for p in model.parameters()]
        return [p.detach().clone() for p in model.parameters()], counts, moments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = InProcessBackend.run(3, worker, timeout_s=60)
    for rank, (params, counts, moments) in enumerate(results):
        assert counts == ([1, 2, 2, 3] if rank == 1 else [1, 2, 3, 4])
        assert all(bool(torch.isfinite(m).all()) for m in moments)
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], params))


def test_bad_settings_and_checkpoints_are_refused_by_name():
    model = make_model()
    with pytest.raises(ValueError, match="Invalid precondition: 'adamw'"):
        DisTrOAdamW(model.parameters(), precondition="adamw")
    with pytest.raises(ValueError, match="per-step mode only"):
        DisTrOAdamW(model.parameters(), precondition="adam", sync_every=4)
    opt = _opt(model, precondition="adam")
    with pytest.raises(ValueError, match="Invalid precondition"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "precondition": "yes"})
    _grads(model, 0)
    _step(opt)
    saved = opt.state_dict()
    saved["state"][0]["input_exp_avg_sq"] = -saved["state"][0]["input_exp_avg_sq"] - 1
    fresh = _opt(model, precondition="adam")
    with pytest.raises(ValueError, match="input_exp_avg_sq of parameter 0 holds negative values"):
        fresh.load_state_dict(saved)
    assert not fresh.state  # refused before anything changed


def test_a_checkpoint_from_before_the_option_loads_without_preconditioning():
    model = make_model()
    opt = _opt(model)
    _grads(model, 0)
    _step(opt)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["precondition"]
    fresh = _opt(model)
    fresh.load_state_dict(saved)
    assert all(g["precondition"] == "none" for g in fresh.param_groups)
    assert math.isfinite(float(fresh.state[next(model.parameters())]["step"]))


@pytest.mark.parametrize("given, explicit", [
    ({}, dict(precondition="adam", update="linear", compression_chunk=16)),
    ({"update": "sign"}, dict(precondition="none", update="sign", compression_chunk=64)),
    ({"precondition": "none"}, dict(precondition="none", update="sign", compression_chunk=64)),
    ({"update": "adam"}, dict(precondition="none", update="adam", compression_chunk=64)),
])
def test_the_defaults_step_as_the_rule_they_name(given, explicit):
    """Left out, the rule is the preconditioned linear update at 16x16 chunks; ``update="sign"`` (or
    ``precondition="none"``) alone is DeMo's rule at its 64x64. Each steps bit for bit as the same
    settings written out, and the group records what ran."""
    ours, spelled = make_model(), make_model()
    spelled.load_state_dict(ours.state_dict())
    opt_ours, opt_spelled = _opt(ours, **{**given, "compression_chunk": None}), _opt(spelled, **explicit)
    assert {k: opt_ours.param_groups[0][k] for k in explicit} == explicit
    assert opt_ours.payload_nbytes == opt_spelled.payload_nbytes
    for t in range(3):
        _grads(ours, t)
        _grads(spelled, t)
        _step(opt_ours)
        _step(opt_spelled)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), spelled.parameters()))


def test_the_local_step_mode_defaults_to_no_preconditioner_and_64x64_chunks():
    opt = DisTrOAdamW(make_model().parameters(), sync_every=4)
    assert (opt.param_groups[0]["precondition"], opt.param_groups[0]["compression_chunk"]) == ("none", 64)
