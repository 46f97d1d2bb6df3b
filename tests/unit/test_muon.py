"""MuonAdamW: torch's Muon on the named groups and torch's AdamW on the rest, as one optimizer, and
as the inner optimizer of DisTrOAdamW's local-step mode (MuLoCo)."""
import io

import pytest
import torch

from distro_opt import DisTrOAdamW, MuonAdamW
from distro_opt.comm import InProcessBackend

from _models import checkpoint_round_trip, make_model, train

LR, WD = 0.01, 0.05


def groups(model):
    """Two groups: the hidden matrices (Muon's), then the biases (AdamW's)."""
    return [{"params": [model[0].weight, model[2].weight]}, {"params": [model[0].bias, model[2].bias]}]


def reference(model):
    """What MuonAdamW(groups(model), muon_groups=[0]) must do: torch's two optimizers, side by side."""
    muon = torch.optim.Muon([model[0].weight, model[2].weight], lr=LR, weight_decay=WD, eps=1e-8,
                            momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([model[0].bias, model[2].bias], lr=LR, weight_decay=WD)
    return muon, adamw


class Both:
    """Two optimizers stepped together, as ``_models.train`` steps one."""

    def __init__(self, *opts):
        self.opts = opts

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()

    def step(self):
        for o in self.opts:
            o.step()


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_muon_adamw_steps_as_torchs_muon_on_the_matrices_and_adamw_on_the_rest():
    model, twin = make_model(), make_model()
    train(model, MuonAdamW(groups(model), lr=LR, weight_decay=WD, muon_groups=[0]), steps=5)
    train(twin, Both(*reference(twin)), steps=5)
    assert same(model, twin)
    assert not same(model, make_model())  # it moved


def test_by_default_muon_takes_the_groups_whose_parameters_are_all_matrices():
    model, twin = make_model(), make_model()
    train(model, MuonAdamW(groups(model), lr=LR, weight_decay=WD), steps=3)
    train(twin, Both(*reference(twin)), steps=3)
    assert same(model, twin)


def test_a_resumed_muon_adamw_takes_the_uninterrupted_steps_bit_for_bit():
    model, twin = make_model(), make_model()
    train(model, MuonAdamW(groups(model), lr=LR, muon_groups=[0]), steps=6)
    opt = MuonAdamW(groups(twin), lr=LR, muon_groups=[0])
    train(twin, opt, steps=3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    resumed = MuonAdamW(groups(twin), lr=LR, muon_groups=[0])
    resumed.load_state_dict(torch.load(buf))
    assert sorted(resumed.state_dict()["state"][0]) == ["momentum_buffer"]
    assert sorted(resumed.state_dict()["state"][2]) == ["exp_avg", "exp_avg_sq", "step"]
    train(twin, resumed, steps=3, start=3)
    assert same(model, twin)


def test_a_group_added_later_takes_adamw_steps_and_the_first_ones_keep_their_state():
    model, twin = make_model(), make_model()
    first, rest = groups(model)
    opt = MuonAdamW([first], lr=LR, weight_decay=WD, muon_groups=[0])
    muon, adamw = reference(twin)
    biases = [m[i].bias for m in (model, twin) for i in (0, 2)]
    for b in biases:  # not trained before their group is added
        b.requires_grad_(False)
    train(model, opt, steps=2)
    train(twin, muon, steps=2)
    for b in biases:
        b.requires_grad_(True)
    opt.add_param_group({**rest, "weight_decay": WD})
    train(model, opt, steps=2, start=2)
    train(twin, Both(muon, adamw), steps=2, start=2)
    assert same(model, twin)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(muon_groups=[1]), ValueError, r"group 1 takes Muon, which steps 2-D parameters only; it holds shapes \[\(32,\), \(4,\)\]"),
    (dict(muon_groups=[2]), ValueError, r"Invalid muon_groups: \[2\] \(indices of the 2 groups\)"),
    (dict(momentun=0.9), TypeError, "unexpected keyword arguments: momentun"),
])
def test_bad_settings_are_refused_naming_them(kwargs, error, message):
    with pytest.raises(error, match=message):
        MuonAdamW(groups(make_model()), **kwargs)


def muloco(model, comm=None):
    return DisTrOAdamW(groups(model), lr=LR, weight_decay=WD, sync_every=4, compression_topk=16,
                       compression_bits=2, comm=comm,
                       inner_optimizer=lambda gs: MuonAdamW(gs, muon_groups=[0]))


def test_the_local_step_modes_inner_steps_are_muon_adamw_steps():
    model, twin = make_model(), make_model()
    opt = muloco(model)
    train(model, opt, steps=3)  # before the first sync at step 4: inner steps only
    train(twin, Both(*reference(twin)), steps=3)
    assert isinstance(opt.inner_optimizer, MuonAdamW) and same(model, twin)


def test_a_local_step_run_with_muon_inside_resumes_bit_identically_across_a_sync():
    straight, first = make_model(), make_model()
    train(straight, muloco(straight), steps=10)
    opt = muloco(first)
    train(first, opt, steps=6)  # two steps past the sync at step 4
    saved = checkpoint_round_trip(first, opt)
    resumed = make_model(seed=7)
    resumed.load_state_dict(saved["model"])
    opt = muloco(resumed)
    opt.load_state_dict(saved["opt"])
    train(resumed, opt, steps=4, start=6)
    assert same(straight, resumed)


def test_workers_with_muon_inside_hold_identical_replicas_after_each_sync_and_apart_between():
    def worker(backend):
        model = make_model()
        opt = muloco(model, comm=backend)
        snapshots = []
        for t in range(8):
            train(model, opt, steps=1, rank=backend.rank, start=t)  # each worker its own batches
            snapshots.append([p.detach().clone() for p in model.parameters()])
        return snapshots

    results = InProcessBackend.run(2, worker, timeout_s=60)
    for t in range(8):
        same_here = all(torch.equal(a, b) for a, b in zip(results[0][t], results[1][t]))
        assert same_here == ((t + 1) % 4 == 0), f"step {t}"
