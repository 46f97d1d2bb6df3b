"""Arm specifications: parsing, option names, validation before training."""

import pytest

from distro_opt.experiments.arms import build_optimizer, check_arm, parse_arms
from distro_opt.experiments.presets import get_preset


def test_arms_with_options_parse_into_optimizer_keywords():
    arms = parse_arms("adamw,distro:topk=8,bits=2,demo")
    assert [a.label for a in arms] == ["adamw", "distro:topk=8,bits=2", "demo"]
    assert arms[1].kind == "distro"
    assert arms[1].options == {"compression_topk": 8, "compression_bits": 2}


def test_full_keyword_names_are_accepted_as_options():
    (arm,) = parse_arms("distro:compression_decay=0.99,update=adam")
    assert arm.options == {"compression_decay": 0.99, "update": "adam"}


def test_unknown_arm_option_is_an_error_naming_it():
    with pytest.raises(ValueError, match="Unknown option 'topkk' for arm 'distro'"):
        parse_arms("distro:topkk=8")


def test_unknown_arm_kind_is_an_error():
    with pytest.raises(ValueError, match="Unknown arm 'sgd'"):
        parse_arms("adamw,sgd")


def test_duplicate_arms_are_rejected():
    with pytest.raises(ValueError, match="twice"):
        parse_arms("distro,distro")


def test_invalid_option_value_fails_before_training():
    (arm,) = parse_arms("distro:topk=0")
    with pytest.raises(ValueError, match="compression_topk"):
        check_arm(arm, get_preset("smoke"))


def test_arm_options_override_the_preset_hyperparameters():
    import torch

    (arm,) = parse_arms("distro:lr=0.01,wd=0")
    opt = build_optimizer(arm, [torch.nn.Parameter(torch.zeros(4, 4))], get_preset("smoke"), None)
    group = opt.param_groups[0]
    assert group["lr"] == 0.01 and group["weight_decay"] == 0 and group["betas"] == (0.9, 0.95)
