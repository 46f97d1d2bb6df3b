"""Hyperparameters of DisTrOAdamW and DeMo: torch-style validation, AdamW's signature and flags,
and param groups that carry their own settings."""
import pytest
import torch

from distro_opt import DisTrOAdamW

from _models import OPTIMIZERS, make_model, train


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1.0), "Invalid learning rate: -1.0"),
        (dict(lr=float("nan")), "Invalid learning rate: nan"),
        (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
        (dict(compression_decay=1.0), "Invalid compression_decay value: 1.0"),
        (dict(compression_topk=0), "Invalid compression_topk value: 0"),
        (dict(compression_chunk=2.5), "Invalid compression_chunk value: 2.5"),
        (dict(compression_bits=3), "Invalid compression_bits: 3"),
    ],
)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_invalid_hyperparameters_raise_torch_style(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(make_model().parameters(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0"), (dict(eps=-1e-8), "Invalid epsilon value"),
     (dict(update="lion"), "Invalid update")],
)
def test_distro_adamw_validates_adam_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DisTrOAdamW(make_model().parameters(), **kwargs)


def test_distro_adamw_accepts_adamw_positional_signature():
    opt = DisTrOAdamW(make_model().parameters(), 3e-4, (0.8, 0.95), 1e-6, 0.1, False)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.1)


def test_distro_adamw_takes_every_keyword_of_torchs_adamw():
    import inspect

    ours = inspect.signature(DisTrOAdamW).parameters
    for name, param in inspect.signature(torch.optim.AdamW).parameters.items():
        assert name in ours and ours[name].default == param.default, name
    DisTrOAdamW(make_model().parameters(), foreach=True, fused=False, update="adam", amsgrad=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(capturable=True), "capturable=True is not supported"),
    (dict(differentiable=True), "differentiable=True is not supported"),
    (dict(amsgrad=True), "amsgrad=True applies to update='adam'"),
])
def test_adamw_flags_this_optimizer_cannot_honour_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DisTrOAdamW(make_model().parameters(), **kwargs)


def test_param_groups_have_their_own_settings():
    model = make_model()
    opt = DisTrOAdamW(
        [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters(), "compression_topk": 16}],
        lr=0.01,
    )
    frozen = [p.detach().clone() for p in model[0].parameters()]
    moved = [p.detach().clone() for p in model[2].parameters()]
    small = DisTrOAdamW(model.parameters()).payload_nbytes
    assert opt.payload_nbytes > small  # topk 16 instead of 4 for the second layer
    train(model, opt, 2)
    assert all(torch.equal(p, f) for p, f in zip(model[0].parameters(), frozen))
    assert not any(torch.equal(p, m) for p, m in zip(model[2].parameters(), moved))


@pytest.mark.parametrize("group, message", [
    (dict(update="momentum"), "Invalid update: 'momentum'"),
    (dict(compression_topk=0), "Invalid compression_topk value: 0"),
    (dict(lr=-0.5), "Invalid learning rate: -0.5"),
    (dict(betas=(1.5, 0.9)), "Invalid beta parameter at index 0: 1.5"),
    (dict(betas=(0.9, float("nan"))), "Invalid beta parameter at index 1: nan"),
    (dict(eps=-1.0), "Invalid epsilon value: -1.0"),
    (dict(eps=float("nan")), "Invalid epsilon value: nan"),
    (dict(outer_lr=-1.0), "Invalid outer_lr value: -1.0"),
    (dict(outer_momentum=1.5), "Invalid outer_momentum value: 1.5"),
    (dict(outer_momentum=float("nan")), "Invalid outer_momentum value: nan"),
])
def test_per_group_settings_are_validated_like_the_constructor(group, message):
    model = make_model()
    first, *rest = list(model.parameters())
    with pytest.raises(ValueError, match=message):
        DisTrOAdamW([{"params": [first]}, {"params": rest, **group}])


def test_add_param_group_validates_the_adam_and_outer_step_settings():
    model = make_model()
    opt = DisTrOAdamW(model[0].parameters(), sync_every=4)
    with pytest.raises(ValueError, match="Invalid outer_momentum value: 1.0"):
        opt.add_param_group({"params": model[2].parameters(), "outer_momentum": 1.0})
    # refused, so not kept: the same parameters can then be added with valid settings
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": model[2].parameters(), "outer_momentum": 0.5})
    before = model[2].weight.detach().clone()
    train(model, opt, 1)  # an inner step: the added layer moves
    assert len(opt.param_groups) == 2 and not torch.equal(before, model[2].weight)


@pytest.mark.parametrize("kwargs, name, kind", [
    (dict(lr="1e-3"), "lr", "str"), (dict(lr=None), "lr", "NoneType"), (dict(weight_decay="0.1"), "weight_decay", "str"),
    (dict(compression_decay=[0.9]), "compression_decay", "list"),
])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_setting_that_is_not_a_number_is_refused_naming_it_and_its_type(cls, kwargs, name, kind):
    with pytest.raises(TypeError, match=rf"Invalid {name}: .* is a {kind}, not a number"):
        cls(make_model().parameters(), **kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(eps="1e-8"), "eps"), (dict(betas=("0.9", 0.99)), r"betas\[0\]"), (dict(outer_lr="1"), "outer_lr"),
])
def test_distro_adamw_refuses_its_own_settings_that_are_not_numbers(kwargs, name):
    with pytest.raises(TypeError, match=rf"Invalid {name}: .* not a number"):
        DisTrOAdamW(make_model().parameters(), **kwargs)


def test_a_group_lr_that_is_a_string_is_refused_and_the_group_not_kept():
    model = make_model()
    opt = DisTrOAdamW(model[0].parameters())
    with pytest.raises(TypeError, match="Invalid lr: '1e-3' is a str"):
        opt.add_param_group({"params": model[2].parameters(), "lr": "1e-3"})
    assert len(opt.param_groups) == 1
    assert DisTrOAdamW(make_model().parameters(), lr=torch.tensor(0.01)).param_groups[0]["lr"] == 0.01  # as torch
