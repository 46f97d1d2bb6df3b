"""DisTrOAdamW's local-step mode (sync_every=H): H local steps, one collective, error feedback kept."""
import functools
import io
import warnings

import pytest
import torch

from distro_opt import DCTTransform, DisTrOAdamW
from distro_opt.comm import InProcessBackend

import _models
from _models import batch, checkpoint_round_trip

H = 4


make_model = functools.partial(_models.make_model, width=64)


def step(model, opt, t, rank=0, scaler=None, inf=False):
    """One training step, under ``scaler`` (a GradScaler) if given; ``inf``: a gradient overflowed."""
    x, y = batch(t, rank)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    (loss if scaler is None else scaler.scale(loss)).backward()
    if inf:
        model[0].weight.grad[0, 0] = float("inf")
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


def make_opt(model, **kw):
    return DisTrOAdamW(model.parameters(), lr=0.01, sync_every=H, compression_topk=16, compression_bits=2, **kw)



def test_takes_h_local_steps_then_exactly_one_collective():
    model = make_model()
    opt = make_opt(model)
    counts = []
    for t in range(2 * H):
        step(model, opt, t)
        counts.append(opt.comm.stats.steps)
    assert counts == [0, 0, 0, 1, 1, 1, 1, 2]


@pytest.mark.parametrize("flags", [{}, {"amsgrad": True, "maximize": True}],
                         ids=["plain", "amsgrad-maximize"])
def test_local_steps_are_inner_adamw_steps(flags):
    model, reference = make_model(), make_model()
    opt = make_opt(model, **flags)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, **flags)
    for t in range(H - 1):
        step(model, opt, t)
        step(reference, ref_opt, t)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_error_feedback_conserves_what_was_to_be_sent():
    model = make_model()
    opt = make_opt(model, compression_decay=0.9)
    transform = DCTTransform()
    for t in range(H - 1):
        step(model, opt, t)
    old = {p: (opt.state[p]["anchor"].clone(), opt.state[p].get("delta")) for p in model.parameters()}
    step(model, opt, H - 1)  # the H-th inner step, then the sync
    local = _params_after_inner_steps(H)
    for (p, (anchor_old, delta_old)), p_local in zip(old.items(), local):
        chunk = transform.chunk_shape(tuple(p.shape), opt.param_groups[0]["compression_chunk"])
        to_send = anchor_old - p_local  # the pseudo-gradient (the decayed carry is added below)
        if delta_old is not None:
            to_send = to_send + 0.9 * transform.inverse(delta_old, chunk)
        sent = anchor_old - opt.state[p]["anchor"]  # one worker, outer_lr 1: the anchor moved by what was sent
        remains = transform.inverse(opt.state[p]["delta"], chunk)
        assert sent.abs().max() > 0 and remains.abs().max() > 0
        torch.testing.assert_close(sent + remains, to_send, atol=1e-6, rtol=1e-5)
        assert torch.equal(p.detach(), opt.state[p]["anchor"])  # the worker restarts from the anchor


def _params_after_inner_steps(steps):
    """Parameters after ``steps`` plain AdamW steps on the same data: the local trajectory."""
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=0.01)
    for t in range(steps):
        step(model, ref, t)
    return [p.detach() for p in model.parameters()]


def test_state_dict_resume_mid_interval_is_bit_identical():
    straight = make_model()
    opt = make_opt(straight)
    for t in range(10):
        step(straight, opt, t)

    first = make_model()
    opt = make_opt(first)
    for t in range(6):  # mid-interval: 2 steps after the sync at step 4
        step(first, opt, t)
    ckpt = checkpoint_round_trip(first, opt)
    resumed = make_model(seed=7)
    resumed.load_state_dict(ckpt["model"])
    opt = make_opt(resumed)
    opt.load_state_dict(ckpt["opt"])
    for t in range(6, 10):
        step(resumed, opt, t)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


def test_replicas_identical_after_each_sync_and_apart_between():
    models = [make_model() for _ in range(3)]

    def worker(backend):
        model = models[backend.rank]
        opt = make_opt(model, comm=backend)
        snapshots = []
        for t in range(2 * H):
            step(model, opt, t, rank=backend.rank)
            snapshots.append([p.detach().clone() for p in model.parameters()])
        return snapshots

    results = InProcessBackend.run(3, worker, timeout_s=60)
    for t in range(2 * H):
        same = all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0][t], r[t]))
        assert same == ((t + 1) % H == 0), f"step {t}"


def test_invalid_local_step_settings_are_rejected():
    with pytest.raises(ValueError, match="Invalid sync_every value: 0"):
        DisTrOAdamW(make_model().parameters(), sync_every=0)
    with pytest.raises(ValueError, match="overlap=True applies to the per-step mode"):
        DisTrOAdamW(make_model().parameters(), sync_every=4, overlap=True)


def test_synced_parameters_are_the_last_sync_on_every_worker_and_local_values_come_back():
    models = [make_model() for _ in range(3)]

    def worker(backend):
        model = models[backend.rank]
        opt = make_opt(model, comm=backend)
        for t in range(H + 2):  # two local steps past the first sync
            step(model, opt, t, rank=backend.rank)
            if t == H - 1:
                at_sync = [p.detach().clone() for p in model.parameters()]
        local = [p.detach().clone() for p in model.parameters()]
        with opt.synced_parameters():
            inside = [p.detach().clone() for p in model.parameters()]
        after = [p.detach().clone() for p in model.parameters()]
        return at_sync, local, inside, after

    results = InProcessBackend.run(3, worker, timeout_s=60)
    for at_sync, local, inside, after in results:
        assert all(torch.equal(a, b) for a, b in zip(inside, results[0][0]))  # the same model everywhere
        assert all(torch.equal(a, b) for a, b in zip(inside, at_sync))  # ... the one of the last sync
        assert not all(torch.equal(a, b) for a, b in zip(inside, local))  # which the replica has left
        assert all(torch.equal(a, b) for a, b in zip(after, local))


def test_synced_parameters_is_a_no_op_in_the_per_step_mode():
    model = make_model()
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    step(model, opt, 0)
    before = [p.detach().clone() for p in model.parameters()]
    with opt.synced_parameters():
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_synced_parameters_before_the_first_step_leave_the_state_empty():
    opt = make_opt(make_model())
    with opt.synced_parameters():
        pass
    assert opt.state_dict()["state"] == {}


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_inner_steps_under_a_grad_scaler_are_adamw_steps_on_the_unscaled_gradients():
    model, reference = make_model(), make_model()
    opt = make_opt(model, eps=1e-3)  # an eps this large: a step on scaled gradients would differ
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, eps=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for t in range(H - 1):
        step(model, opt, t, scaler=scaler)
        step(reference, ref_opt, t)
    assert same(model, reference)


def test_syncs_under_a_grad_scaler_move_the_model_as_without_one():
    plain, scaled = make_model(), make_model()
    opt, scaled_opt = make_opt(plain), make_opt(scaled)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for t in range(2 * H):
        step(plain, opt, t)
        step(scaled, scaled_opt, t, scaler=scaler)
    assert scaled_opt.comm.stats.steps == 2
    assert same(plain, scaled)


@pytest.mark.parametrize("bad", [1, H - 1], ids=["inner step", "sync step"])
def test_a_grad_scaler_overflow_skips_only_that_inner_step_and_the_interval_is_still_sent(bad):
    plain, scaled = make_model(), make_model()
    opt, scaled_opt = make_opt(plain), make_opt(scaled)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(H):  # without a scaler, the same inf skips the same inner step
            step(plain, opt, t, inf=t == bad)
            step(scaled, scaled_opt, t, scaler=scaler, inf=t == bad)
    assert [str(w.message) for w in caught if "is skipped" in str(w.message)] == [
        "distro-opt: non-finite local gradient; this inner step is skipped",
        "distro-opt: GradScaler found inf/NaN gradients; this inner step is skipped",
    ]
    assert scaled_opt.comm.stats.steps == 1 and not same(scaled, make_model())  # the sync moved the model
    assert same(plain, scaled)


def _two_groups(model, added_later):
    """An optimizer over model[0] (lr 0.01) and model[2] (lr 0.02): built with both groups, or
    with the first and then ``add_param_group``."""
    first = {"params": list(model[0].parameters())}
    second = {"params": list(model[2].parameters()), "lr": 0.02}
    groups = [first] if added_later else [first, second]
    opt = DisTrOAdamW(groups, lr=0.01, sync_every=H, compression_topk=16, compression_bits=2)
    if added_later:
        opt.add_param_group(second)
    return opt


def test_a_param_group_added_in_the_local_step_mode_takes_inner_adamw_steps():
    model, reference = make_model(), make_model()
    opt = _two_groups(model, added_later=True)
    ref_opt = torch.optim.AdamW(reference[0].parameters(), lr=0.01)
    ref_opt.add_param_group({"params": reference[2].parameters(), "lr": 0.02})
    for t in range(H - 1):
        step(model, opt, t)
        step(reference, ref_opt, t)
    assert same(model, reference)


def test_a_checkpoint_taken_after_add_param_group_resumes_where_both_groups_were_given_at_once():
    straight = make_model()
    opt = _two_groups(straight, added_later=True)
    for t in range(10):
        step(straight, opt, t)

    first = make_model()
    opt = _two_groups(first, added_later=True)
    for t in range(6):
        step(first, opt, t)
    ckpt = checkpoint_round_trip(first, opt)
    resumed = make_model(seed=7)
    resumed.load_state_dict(ckpt["model"])
    opt = _two_groups(resumed, added_later=False)
    opt.load_state_dict(ckpt["opt"])
    for t in range(6, 10):
        step(resumed, opt, t)
    assert same(straight, resumed)


def _as_saved_with_a_whole_inner_state_dict(opt):
    """``opt``'s checkpoint in the layout that kept the inner optimizer's state dict whole under
    "inner" and the local-step count in "state" (still read)."""
    ckpt = opt.state_dict()
    count = ckpt["param_groups"][0]["local_step"]
    ckpt["param_groups"] = [{k: v for k, v in g.items() if k != "local_step"} for g in ckpt["param_groups"]]
    ckpt["state"] = {i: {k: v for k, v in st.items() if not k.startswith("inner.")} for i, st in ckpt["state"].items()}
    ckpt["state"]["local_step"] = count
    ckpt["inner"] = opt.inner_optimizer.state_dict()
    return ckpt


def test_a_checkpoint_with_a_whole_inner_state_dict_resumes_bit_identically():
    straight = make_model()
    opt = make_opt(straight)
    for t in range(2 * H + 2):
        step(straight, opt, t)
    first = make_model()
    opt = make_opt(first)
    for t in range(H + 1):
        step(first, opt, t)
    ckpt = {"model": first.state_dict(), "opt": _as_saved_with_a_whole_inner_state_dict(opt)}
    resumed = make_model(seed=7)
    resumed.load_state_dict(ckpt["model"])
    opt = make_opt(resumed)
    opt.load_state_dict(ckpt["opt"])
    for t in range(H + 1, 2 * H + 2):
        step(resumed, opt, t)
    assert same(straight, resumed)


def test_a_checkpoint_keeps_the_local_step_count_in_its_groups_and_the_inner_state_per_parameter():
    """What torch.distributed.checkpoint keeps: the groups and the parameters' states."""
    model = make_model()
    opt = make_opt(model)
    for t in range(H + 1):
        step(model, opt, t)
    ckpt = opt.state_dict()
    assert set(ckpt) == {"state", "param_groups", "delta_layout", "optimizer"}
    assert [g["local_step"] for g in ckpt["param_groups"]] == [H + 1]
    assert all(isinstance(i, int) for i in ckpt["state"])
    inner = opt.inner_optimizer.state
    for i, p in enumerate(model.parameters()):
        assert torch.equal(ckpt["state"][i]["inner.exp_avg"], inner[p]["exp_avg"])
    assert "local_step" not in opt.param_groups[0]


def test_a_checkpoint_whose_inner_optimizer_lacks_a_group_is_refused_before_anything_changes():
    saver = make_model()
    opt = _two_groups(saver, added_later=False)
    for t in range(H + 1):
        step(saver, opt, t)
    ckpt = _as_saved_with_a_whole_inner_state_dict(opt)
    # as saved before add_param_group reached the inner optimizer
    ckpt["inner"] = {**ckpt["inner"], "param_groups": ckpt["inner"]["param_groups"][:1]}
    model = make_model()
    opt = _two_groups(model, added_later=False)
    step(model, opt, 0)
    before = io.BytesIO()
    torch.save(opt.state_dict(), before)
    with pytest.raises(ValueError, match="inner optimizer"):
        opt.load_state_dict(ckpt)
    after = io.BytesIO()
    torch.save(opt.state_dict(), after)
    assert before.getvalue() == after.getvalue()


def test_betas_eps_and_weight_decay_set_in_param_groups_reach_the_inner_steps():
    model, reference = make_model(), make_model()
    opt = make_opt(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for t in range(H - 1):
        for o in (opt, ref_opt):  # what a schedule does (OneCycleLR's cycle_momentum: betas)
            o.param_groups[0].update(betas=(0.9 - 0.05 * t, 0.99), eps=10.0 ** -(3 + t), weight_decay=t / 2)
        step(model, opt, t)
        step(reference, ref_opt, t)
    assert same(model, reference)


def sgd(groups):
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)


def test_an_inner_optimizer_factory_leaves_this_optimizers_groups_as_they_were():
    model = make_model()
    opt = make_opt(model, inner_optimizer=sgd)
    step(model, opt, 0)
    assert [set(g) for g in opt.param_groups] == [set(g) for g in make_opt(make_model()).param_groups]


def test_an_inner_optimizer_without_one_group_per_group_is_refused():
    model = make_model()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]

    def merged(inner_groups):
        return sgd([p for g in inner_groups for p in g["params"]])

    with pytest.raises(ValueError, match="inner_optimizer has 1 parameter groups, expected 2"):
        DisTrOAdamW(groups, sync_every=H, inner_optimizer=merged)


def test_an_inner_optimizer_factory_steps_with_this_optimizers_lr_and_weight_decay():
    model, reference = make_model(), make_model()
    opt = make_opt(model, inner_optimizer=sgd, weight_decay=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1)
    for t in range(H - 1):
        step(model, opt, t)
        step(reference, ref_opt, t)
    assert same(model, reference)


def test_synced_parameters_hold_the_agreed_value_of_a_parameter_frozen_mid_interval():
    models = [make_model() for _ in range(2)]

    def worker(backend):
        model = models[backend.rank]
        opt = make_opt(model, comm=backend)
        for t in range(H - 1):
            if t == 2:
                model[0].weight.requires_grad_(False)  # after two inner steps of its own
            step(model, opt, t, rank=backend.rank)
        local = model[0].weight.detach().clone()
        with opt.synced_parameters():
            inside = [p.detach().clone() for p in model.parameters()]
        return inside, local, model[0].weight.detach().clone()

    (inside0, local0, after0), (inside1, local1, after1) = InProcessBackend.run(2, worker, timeout_s=60)
    assert not torch.equal(local0, local1)  # each worker's own drift
    assert all(torch.equal(a, b) for a, b in zip(inside0, inside1))
    assert torch.equal(after0, local0) and torch.equal(after1, local1)


def test_a_parameter_frozen_mid_interval_goes_back_to_the_last_syncs_value_at_the_next_sync():
    models = [make_model() for _ in range(2)]
    start = make_model()[0].weight.detach().clone()  # the first anchor: the starting point

    def worker(backend):
        model = models[backend.rank]
        opt = make_opt(model, comm=backend)
        for t in range(H):
            if t == 2:
                model[0].weight.requires_grad_(False)  # after two inner steps of its own
            step(model, opt, t, rank=backend.rank)
        return [p.detach().clone() for p in model.parameters()]

    after0, after1 = InProcessBackend.run(2, worker, timeout_s=60)
    assert torch.equal(after0[0], start) and torch.equal(after1[0], start)
    assert all(torch.equal(a, b) for a, b in zip(after0, after1))  # the replicas agree after the sync


def test_an_fp16_gradient_whose_norm_is_beyond_fp16s_range_still_takes_its_inner_step():
    p, ref = (torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.float16)) for _ in range(2))
    opt = DisTrOAdamW([p], lr=0.01, sync_every=H)
    ref_opt = torch.optim.AdamW([ref], lr=0.01)
    p.grad, ref.grad = (torch.full((64, 64), 2000.0, dtype=torch.float16) for _ in range(2))  # norm 128,000
    assert opt.comm.world_size == 1  # resolved here, with its single-worker notice, not in the block
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    ref_opt.step()
    assert p.abs().min() > 0 and torch.equal(p, ref)
