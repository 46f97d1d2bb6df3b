"""Compression warm-up (distro_opt.warmup): lightly compressed first steps, then each group's own setting."""
import pytest
import torch

from _models import batch, make_model, train
from distro_opt import DisTrOAdamW
from distro_opt import CompressionWarmup


def _groups(model, embed_topk, rest_topk):
    """Two param groups with their own top-k (the runner's per-kind settings)."""
    first, *rest = model.parameters()
    return [{"params": [first], "compression_topk": embed_topk}, {"params": rest, "compression_topk": rest_topk}]


def _train_with_warmup(model, opt, warmup, steps, start=0):
    for t in range(start, start + steps):
        x, y = batch(t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        warmup.step()


def test_payload_is_the_warmups_for_its_steps_then_each_groups_own():
    model = make_model()
    opt = DisTrOAdamW(_groups(model, 3, 5), lr=0.01)
    own = opt.payload_nbytes
    warm = DisTrOAdamW(_groups(make_model(), 16, 16), lr=0.01, compression_bits=2).payload_nbytes
    warmup = CompressionWarmup(opt, steps=2, topk=16, bits=2)
    sizes = [opt.payload_nbytes]
    _train_with_warmup(model, opt, warmup, steps=3)
    sizes.append(opt.payload_nbytes)
    assert warm > own and sizes == [warm, own]
    assert [(g["compression_topk"], g["compression_bits"]) for g in opt.param_groups] == [(3, 1), (5, 1)]


def test_warmup_trains_as_a_lightly_compressed_optimizer_handed_over_through_a_checkpoint():
    """Reference: an optimizer built with the warm-up's setting for its steps, whose state_dict is
    then loaded into one built with the groups' own settings."""
    steps, warm_steps = 6, 3
    model = make_model()
    warm = DisTrOAdamW(_groups(model, 16, 16), lr=0.01, compression_bits=2)
    train(model, warm, warm_steps)
    state = warm.state_dict()
    for group, topk in zip(state["param_groups"], (3, 5)):
        group["compression_topk"], group["compression_bits"] = topk, 1
    handed = DisTrOAdamW(_groups(model, 3, 5), lr=0.01)
    handed.load_state_dict(state)
    train(model, handed, steps - warm_steps, start=warm_steps)

    ours = make_model()
    opt = DisTrOAdamW(_groups(ours, 3, 5), lr=0.01)
    _train_with_warmup(ours, opt, CompressionWarmup(opt, steps=warm_steps, topk=16, bits=2), steps)
    for a, b in zip(ours.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_resumed_warmup_continues_as_the_uninterrupted_one():
    """Saved mid-warm-up (the optimizer's groups then hold the warm-up's values), loaded into a new
    optimizer and warm-up: the run ends bit for bit as without the interruption."""
    straight = make_model()
    opt = DisTrOAdamW(_groups(straight, 3, 5), lr=0.01)
    _train_with_warmup(straight, opt, CompressionWarmup(opt, steps=4, topk=12), steps=7)

    model = make_model()
    opt = DisTrOAdamW(_groups(model, 3, 5), lr=0.01)
    warmup = CompressionWarmup(opt, steps=4, topk=12)
    _train_with_warmup(model, opt, warmup, steps=2)
    saved, saved_warmup = opt.state_dict(), warmup.state_dict()
    opt = DisTrOAdamW(_groups(model, 3, 5), lr=0.01)
    opt.load_state_dict(saved)
    warmup = CompressionWarmup(opt, steps=4, topk=12)
    warmup.load_state_dict(saved_warmup)
    _train_with_warmup(model, opt, warmup, steps=5, start=2)
    for a, b in zip(model.parameters(), straight.parameters()):
        assert torch.equal(a, b)


def test_zero_warmup_steps_change_nothing():
    straight, model = make_model(), make_model()
    train(straight, DisTrOAdamW(straight.parameters(), lr=0.01), 3)
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    _train_with_warmup(model, opt, CompressionWarmup(opt, steps=0), steps=3)
    for a, b in zip(model.parameters(), straight.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=-1, topk=8), "Invalid warm-up steps: -1"),
    (dict(steps=2.5, topk=8), "Invalid warm-up steps: 2.5"),
    (dict(steps=3), "needs topk or bits"),
    (dict(steps=3, topk=0), "Invalid compression_topk value: 0"),
    (dict(steps=3, bits=3), "compression_bits"),
])
def test_bad_warmup_settings_are_refused_by_name(kwargs, message):
    opt = DisTrOAdamW(make_model().parameters())
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match=message):
        CompressionWarmup(opt, **kwargs)
    assert [dict(g) for g in opt.param_groups] == before


def test_warmup_state_of_another_optimizer_is_refused():
    model = make_model()
    opt = DisTrOAdamW(_groups(model, 3, 5))
    with pytest.raises(ValueError, match="state for 1 param groups, the optimizer has 2"):
        CompressionWarmup(opt, steps=2, topk=8).load_state_dict({"last_step": 1, "own": [{
            "compression_topk": 4, "compression_bits": 1}]})
