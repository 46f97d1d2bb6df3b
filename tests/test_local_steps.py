"""DisTrOAdamW's local-step mode (sync_every=H): H local steps, one collective, error feedback kept."""
import io

import pytest
import torch

from distro_opt import DCTTransform, DisTrOAdamW
from distro_opt.comm import InProcessBackend

H = 4


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def step(model, opt, t, rank=0):
    g = torch.Generator().manual_seed(1000 * rank + t)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


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


def test_local_steps_are_inner_adamw_steps():
    model, reference = make_model(), make_model()
    opt = make_opt(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
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
        chunk = transform.chunk_shape(tuple(p.shape), 64)
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
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
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
