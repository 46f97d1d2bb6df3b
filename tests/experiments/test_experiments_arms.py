"""Arm specifications: parsing, option names, validation before training."""

import re

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


@pytest.mark.parametrize("text", ["adamw:topk=4", "adamw:capturable=true", "adamw:differentiable=true",
                                  "distro:inner_optimizer=foo"])
def test_options_the_runner_cannot_run_are_unknown_and_adamw_lists_no_compression_alias(text):
    with pytest.raises(ValueError, match="Unknown option") as info:
        parse_arms(text)
    known = str(info.value).split("known: ")[1]
    assert "topk" not in known.split(", ") if text.startswith("adamw") else "compression_topk" in known
    assert "capturable" not in known and "inner_optimizer" not in known


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
    opt = build_optimizer(arm, [("w", torch.nn.Parameter(torch.zeros(4, 4)))], get_preset("smoke"), None)
    group = opt.param_groups[0]
    assert group["lr"] == 0.01 and group["weight_decay"] == 0 and group["betas"] == (0.9, 0.95)


def test_per_kind_options_make_one_param_group_per_kind():
    import torch

    from distro_opt.experiments.model import build_model

    (arm,) = parse_arms("distro:update=sign,topk=8,embed.update=adam,norm.lr=0.0003,matrix.bits=2")
    assert arm.options == {"update": "sign", "compression_topk": 8, "embed.update": "adam", "norm.lr": 0.0003, "matrix.compression_bits": 2}
    preset = get_preset("smoke")
    model = build_model(preset.model_config(), seed=0)
    opt = build_optimizer(arm, model.named_parameters(), preset, None)
    embed, norm, matrix = opt.param_groups
    assert embed["params"] == [model.embed.weight] and embed["update"] == "adam" and embed["lr"] == preset.lr
    assert all(p.dim() == 1 for p in norm["params"]) and norm["lr"] == 0.0003 and norm["update"] == "sign"
    assert all(p.dim() == 2 for p in matrix["params"]) and matrix["compression_bits"] == 2
    assert all(g["compression_topk"] == 8 for g in opt.param_groups)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    torch.testing.assert_close(sum(p.numel() for g in opt.param_groups for p in g["params"]),
                               sum(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("text, message", [
    ("distro:head.lr=0.1", "Unknown per-kind option 'head.lr'"),
    ("distro:embed.sync_every=8", "Unknown per-kind option 'embed.sync_every'"),
])
def test_unknown_per_kind_option_is_an_error_naming_it(text, message):
    with pytest.raises(ValueError, match=message):
        parse_arms(text)


def test_invalid_per_kind_value_fails_before_training():
    (arm,) = parse_arms("distro:norm.update=momentum")
    with pytest.raises(ValueError, match="Invalid arm"):
        check_arm(arm, get_preset("smoke"))


@pytest.mark.parametrize("word, value", [
    ("no", False), ("off", False), ("false", False), ("0", False),
    ("yes", True), ("ON", True), ("true", True), ("1", True),
])
def test_boolean_option_takes_the_words_the_preset_flags_take(word, value):
    (arm,) = parse_arms(f"distro:overlap={word}")
    assert arm.options == {"overlap": value}


@pytest.mark.parametrize("text, message", [
    ("distro:overlap=maybe", "Invalid value 'maybe' for option 'overlap' of arm 'distro:overlap=maybe'"),
    ("adamw:foreach=maybe", "Invalid value 'maybe' for option 'foreach'"),
    ("distro:topk=8.5", "Invalid value '8.5' for option 'compression_topk'.*an integer"),
    ("distro:norm.lr=fast", "Invalid value 'fast' for option 'lr'.*a number"),
])
def test_option_value_that_does_not_fit_its_type_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_arms(text)


def test_numeric_options_take_the_optimizer_parameter_type():
    (arm,) = parse_arms("distro:lr=1,topk=8,update=adam")
    assert arm.options == {"lr": 1.0, "compression_topk": 8, "update": "adam"}
    assert isinstance(arm.options["lr"], float) and isinstance(arm.options["compression_topk"], int)


@pytest.mark.parametrize("text, first, second", [
    ("adamw,adamw:", "adamw", "adamw:"),
    ("distro:update=adam,distro:update=Adam", "distro:update=adam", "distro:update=Adam"),
])
def test_arms_that_would_share_result_files_are_refused_naming_both(text, first, second):
    with pytest.raises(ValueError, match=f"'{first}' and '{second}' would share result files"):
        parse_arms(text)


def test_inner_muon_steps_the_hidden_matrices_with_muon_and_the_rest_with_adamw():
    import torch

    from distro_opt import MuonAdamW
    from distro_opt.experiments.model import build_model

    preset = get_preset("smoke")
    model = build_model(preset.model_config(), seed=0)
    (arm,) = parse_arms("distro:sync_every=4,inner=muon")
    opt = build_optimizer(arm, model.named_parameters(), preset, None)
    assert isinstance(opt.inner_optimizer, MuonAdamW)
    x = torch.randint(0, preset.vocab_size, (2, 16))
    model(x).float().logsumexp(-1).mean().backward()
    opt.step()  # an inner step
    kinds = {n: sorted(opt.inner_optimizer.state[p]) for n, p in model.named_parameters()}
    assert kinds["embed.weight"] == ["exp_avg", "exp_avg_sq", "step"]
    matrices = [n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    assert matrices and all(kinds[n] == ["momentum_buffer"] for n in matrices)
    assert all(kinds[n] == ["exp_avg", "exp_avg_sq", "step"] for n, p in model.named_parameters() if p.dim() == 1)


@pytest.mark.parametrize("text, message", [
    ("distro:inner=muon", "inner=muon is the local-step mode's inner optimizer: it needs sync_every (H) > 1"),
    ("distro:H=4,inner=sgd", "Invalid inner optimizer 'sgd' (expected one of adamw, muon)"),
    ("demo:inner=muon", "Unknown option 'inner' for arm 'demo'"),
])
def test_an_inner_optimizer_the_arm_cannot_run_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        for arm in parse_arms(text):
            check_arm(arm, get_preset("smoke"))
