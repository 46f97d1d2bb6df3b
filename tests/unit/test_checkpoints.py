"""state_dict / load_state_dict: bit-identical resumes, checkpoints of older layouts read as saved,
and checkpoints this optimizer cannot resume refused before anything changes."""
import copy
import io

import pytest
import torch

from distro_opt import DeMo, DisTrOAdamW

from _models import OPTIMIZERS, batch, make_model, train


@pytest.mark.parametrize("cls, extra", [(DeMo, {}), (DisTrOAdamW, {"update": "sign"}), (DisTrOAdamW, {"update": "adam"})])
def test_state_dict_resume_is_bit_identical(cls, extra):
    straight = make_model()
    opt = cls(straight.parameters(), lr=0.01, **extra)
    train(straight, opt, 10)

    first = make_model()
    opt = cls(first.parameters(), lr=0.01, **extra)
    train(first, opt, 5)
    saved = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, saved)
    saved.seek(0)
    ckpt = torch.load(saved)
    resumed = make_model(seed=123)
    resumed.load_state_dict(ckpt["model"])
    opt = cls(resumed.parameters(), lr=0.01, **extra)
    opt.load_state_dict(ckpt["opt"])
    train(resumed, opt, 5, start=5)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_state_dict_holds_every_tensor_of_state():
    model = make_model()
    opt = DisTrOAdamW(model.parameters(), update="adam")
    train(model, opt, 1)
    state = opt.state_dict()["state"][0]
    assert set(state) == {"step", "delta", "exp_avg", "exp_avg_sq"}
    assert state["delta"].abs().sum() > 0  # error feedback kept what was not sent


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_copying_or_pickling_the_optimizer_object_says_to_use_state_dict(cls):
    """torch's own pickling of an optimizer keeps only defaults, state and param_groups, which would
    give an object that fails at its first step: refused up front, with the supported way named."""
    model = make_model()
    opt = cls(model.parameters(), lr=0.01)
    train(model, opt, 2)
    with pytest.raises(TypeError, match=r"cannot be deep-copied or pickled whole.*state_dict\(\)"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="load_state_dict"):
        torch.save(opt, io.BytesIO())
    train(model, opt, 1, start=2)  # the refusal changed nothing


def test_bf16_model_keeps_float32_buffers_across_resume():
    model = make_model().to(torch.bfloat16)
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    x, y = batch(0)
    torch.nn.functional.cross_entropy(model(x.bfloat16()), y).backward()
    opt.step()
    saved = opt.state_dict()
    fresh = DisTrOAdamW(model.parameters(), lr=0.01)
    fresh.load_state_dict(saved)
    for p in model.parameters():
        assert fresh.state[p]["delta"].dtype == torch.float32
        assert torch.equal(fresh.state[p]["delta"], opt.state[p]["delta"])


def test_a_refused_load_keeps_the_overlap_update_in_flight():
    """torch refuses a checkpoint of another number of groups only inside its load_state_dict: the
    update still travelling must survive that, as if the load had not been tried."""
    runs = []
    for refused in (False, True):
        model = make_model()
        opt = DisTrOAdamW(model.parameters(), lr=0.01, overlap=True)
        train(model, opt, 2)
        if refused:  # a checkpoint of a twin with two groups (opt.state_dict() would flush opt)
            twin = make_model()
            other = DisTrOAdamW([{"params": twin[0].parameters()}, {"params": twin[2].parameters()}], lr=0.01)
            train(twin, other, 1)
            with pytest.raises(ValueError, match="different number of parameter groups"):
                opt.load_state_dict(other.state_dict())
        opt.flush()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _trained_state(model, cls=DisTrOAdamW, **settings):
    opt = cls(model.parameters(), lr=0.01, **settings)
    train(model, opt, 1)
    return opt.state_dict()


def _edited(saved, group=None, state0=None):
    """A copy of ``saved`` with ``group`` set in its first param group and ``state0`` applied to the
    state of parameter 0."""
    saved = dict(saved, param_groups=[dict(g) for g in saved["param_groups"]],
                 state={i: dict(st) for i, st in saved["state"].items()})
    saved["param_groups"][0].update(group or {})
    if state0 is not None:
        state0(saved["state"][0])
    return saved


@pytest.mark.parametrize("make, match", [
    (lambda m: _trained_state(m, DeMo), "checkpoint is of a DeMo, not a DisTrOAdamW"),
    (lambda m: _trained_state(m, torch.optim.AdamW), "group 0 lacks compression_bits, compression_chunk"),
    (lambda m: _edited(_trained_state(m), group={"lr": -0.01}), "group 0: Invalid learning rate: -0.01"),
    (lambda m: _edited(_trained_state(m), group={"update": "lion"}), "param group 0: Invalid update: 'lion'"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.pop("step")), "one of delta and step"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.update(delta=st["delta"].long())),
     "delta of parameter 0 is not a floating-point tensor"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.update(delta=st["delta"] * float("nan"))),
     "delta of parameter 0 holds non-finite values"),
    (lambda m: _edited(_trained_state(m, update="adam"),
                       state0=lambda st: st.update(exp_avg=st["exp_avg"][1:])),
     r"exp_avg of parameter 0 is not a tensor of its shape \(32, 16\)"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.update(step="x")),
     "step of parameter 0 is 'x', not a count of steps"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.update(step=torch.tensor(float("nan")))),
     "step of parameter 0 is tensor"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.update(step=torch.tensor(-5.0))),
     "step of parameter 0 is tensor"),
    (lambda m: _edited(_trained_state(m, update="adam"),
                       state0=lambda st: st.update(exp_avg=st["exp_avg"] * float("nan"))),
     "exp_avg of parameter 0 holds non-finite values"),
    (lambda m: _edited(_trained_state(m, update="adam"),
                       state0=lambda st: st.update(exp_avg_sq=-st["exp_avg_sq"] - 1)),
     "exp_avg_sq of parameter 0 holds negative values"),
], ids=["DeMo's", "torch AdamW's", "negative lr", "unknown update", "no step", "integer delta", "NaN delta",
        "exp_avg of another shape", "string step", "NaN step", "negative step", "NaN exp_avg",
        "negative exp_avg_sq"])
def test_a_checkpoint_this_optimizer_cannot_resume_is_refused_before_anything_changes(make, match):
    model = make_model()
    saved = make(model)
    target = DisTrOAdamW(model.parameters(), lr=0.01, update="adam")
    train(model, target, 1)
    before = [{k: v.clone() for k, v in target.state[p].items()} for p in model.parameters()]
    groups = [dict(g, params=None) for g in target.param_groups]
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(saved)
    for p, state in zip(model.parameters(), before):
        assert all(torch.equal(state[k], target.state[p][k]) for k in state)
    assert [dict(g, params=None) for g in target.param_groups] == groups


@pytest.mark.parametrize("as_saved", [int, lambda t: torch.tensor(t, dtype=torch.int64)],
                         ids=["int", "int64"])
def test_a_step_count_saved_as_a_number_or_integer_tensor_resumes_like_the_float_one(as_saved):
    runs = []
    for convert in (False, True):
        model = make_model()
        opt = DisTrOAdamW(model.parameters(), lr=0.01, update="adam")
        train(model, opt, 2)
        saved = opt.state_dict()
        if convert:
            saved = _edited(saved)
            for st in saved["state"].values():
                st["step"] = as_saved(int(st["step"]))
        fresh = DisTrOAdamW(model.parameters(), lr=0.01, update="adam")
        fresh.load_state_dict(saved)
        train(model, fresh, 2)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_checkpoint_saved_before_the_adamw_flags_existed_loads_with_their_defaults():
    model = make_model()
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    train(model, opt, 1)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        for key in ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused"):
            del group[key]
    fresh = DisTrOAdamW(model.parameters(), lr=0.01)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["maximize"] is False and fresh.param_groups[0]["fused"] is None
    train(model, fresh, 1)


# the old layout is read with the checkpoint's own chunk size, whatever the loading optimizer's is
@pytest.mark.parametrize("saved_chunk, loading_chunk", [(64, 64), (16, 64)])
def test_checkpoint_with_chunk_rows_from_an_older_version_loads_into_the_parameters_layout(
    saved_chunk, loading_chunk
):
    from distro_opt import DCTTransform

    model = make_model(width=128)
    opt = DisTrOAdamW(model.parameters(), lr=0.01, compression_chunk=saved_chunk)
    train(model, opt, 2)
    saved = opt.state_dict()
    assert saved["delta_layout"] == "tensor"
    shapes = [tuple(p.shape) for p in model.parameters()]
    chunks = [DCTTransform.chunk_shape(s, saved_chunk) for s in shapes]
    assert not all(DCTTransform.own_layout_is_chunk_major(s, c) for s, c in zip(shapes, chunks))
    old_format = {"state": {}, "param_groups": saved["param_groups"]}  # as distro-opt saved it before
    for (i, s), p in zip(saved["state"].items(), model.parameters()):
        chunk = DCTTransform.chunk_shape(tuple(p.shape), saved_chunk)
        old_format["state"][i] = dict(s, delta=DCTTransform.chunk_rows(s["delta"], chunk).clone())
    fresh = DisTrOAdamW(model.parameters(), lr=0.01, compression_chunk=loading_chunk)
    fresh.load_state_dict(old_format)
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["delta"], opt.state[p]["delta"])


def test_checkpoint_with_an_unknown_delta_layout_or_wrong_shape_is_refused():
    model = make_model()
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    train(model, opt, 1)
    saved = opt.state_dict()
    with pytest.raises(ValueError, match="unknown delta_layout"):
        DisTrOAdamW(model.parameters(), lr=0.01).load_state_dict(dict(saved, delta_layout="columns"))
    bad = {"state": {i: dict(s, delta=s["delta"].reshape(-1)[:-1]) for i, s in saved["state"].items()},
           "param_groups": saved["param_groups"], "delta_layout": "tensor"}
    target = DisTrOAdamW(model.parameters(), lr=0.01)
    train(model, target, 1)
    before = {p: target.state[p]["delta"].clone() for p in model.parameters()}
    with pytest.raises(ValueError, match="delta for parameter 0 has shape"):
        target.load_state_dict(bad)
    assert all(torch.equal(target.state[p]["delta"], d) for p, d in before.items())  # nothing changed


def test_an_old_checkpoint_whose_rows_have_the_parameters_shape_is_still_read_as_rows():
    """A (128, 4096) matrix of 64x64 chunks has 128 chunk rows of 4096: its shape either way. A
    checkpoint without a delta_layout entry is then read as rows, as before that entry existed."""
    from distro_opt import DCTTransform

    p = torch.nn.Parameter(torch.randn(128, 4096, generator=torch.Generator().manual_seed(0)))
    opt = DisTrOAdamW([p], lr=0.01, compression_chunk=64)
    for _ in range(2):
        p.grad = torch.randn(128, 4096, generator=torch.Generator().manual_seed(1))
        opt.step()
    saved = opt.state_dict()
    rows = DCTTransform.chunk_rows(saved["state"][0]["delta"], (64, 64)).clone()
    assert rows.shape == p.shape and not torch.equal(rows, saved["state"][0]["delta"])
    fresh = DisTrOAdamW([p], lr=0.01, compression_chunk=64)
    old_format = {"state": {0: dict(saved["state"][0], delta=rows)}, "param_groups": saved["param_groups"]}
    fresh.load_state_dict(old_format)
    assert torch.equal(fresh.state[p]["delta"], opt.state[p]["delta"])


def test_a_checkpoint_without_its_delta_layout_entry_is_told_by_the_shapes():
    model = make_model(width=128)
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    train(model, opt, 2)
    saved = opt.state_dict()
    del saved["delta_layout"]
    fresh = DisTrOAdamW(model.parameters(), lr=0.01)
    fresh.load_state_dict(saved)
    assert all(torch.equal(fresh.state[p]["delta"], opt.state[p]["delta"]) for p in model.parameters())


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_checkpoint_missing_the_state_of_a_parameter_with_state_here_is_refused_before_anything_changes(cls):
    """torch would reset that parameter's error feedback silently; refused, naming the parameter."""
    model = make_model()
    opt = cls(model.parameters(), lr=0.01)
    train(model, opt, 2)
    saved = opt.state_dict()
    del saved["state"][2]  # the second Linear's weight
    train(model, opt, 1, start=2)
    before = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    with pytest.raises(ValueError, match=r"no state for parameter 2 \(param group 0, shape \(4, 32\)\).*delta"):
        opt.load_state_dict(saved)
    for p, state in zip(model.parameters(), before):
        assert set(state) == set(opt.state[p]) and all(torch.equal(state[k], opt.state[p][k]) for k in state)
    fresh = cls(make_model().parameters(), lr=0.01)  # nothing to lose: loads as torch's would
    fresh.load_state_dict(saved)
    assert len(fresh.state) == 3


def test_a_checkpoint_whose_lr_is_a_string_is_refused_naming_the_group_and_the_type():
    model = make_model()
    saved = _edited(_trained_state(model), group={"lr": "1e-3"})
    target = DisTrOAdamW(model.parameters(), lr=0.01)
    with pytest.raises(TypeError, match=r"param group 0: Invalid lr: '1e-3' is a str, not a number"):
        target.load_state_dict(saved)
    assert target.param_groups[0]["lr"] == 0.01
