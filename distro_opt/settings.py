"""Validation of the optimizers' settings, torch-style: messages like "Invalid learning rate: {lr}",
checks written ``not 0.0 <= x`` so that NaN is rejected too. Run by the constructors, by
``add_param_group`` for a group's own values, and on a checkpoint's groups before it is loaded."""
from __future__ import annotations

import numbers

import torch

from .values import value_codec


def check_number(name: str, value) -> None:
    """A real-valued setting is a number (or a one-element real tensor, as torch allows for lr):
    ``lr="1e-3"`` is refused naming the setting and its type, where a comparison would raise
    Python's bare TypeError."""
    if torch.is_tensor(value):
        ok = value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    else:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok:
        raise TypeError(f"Invalid {name}: {value!r} is a {type(value).__name__}, not a number "
                        f"(pass a float such as {name}=1e-3)")


def check_hyperparameters(lr, weight_decay, compression_decay, compression_topk, compression_chunk, compression_bits):
    """torch-style validation (``not 0.0 <= x`` so that NaN is rejected too)."""
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("compression_decay", compression_decay)):
        check_number(name, value)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not 0.0 <= compression_decay < 1.0:
        raise ValueError(f"Invalid compression_decay value: {compression_decay}")
    if not (isinstance(compression_topk, int) and compression_topk >= 1):
        raise ValueError(f"Invalid compression_topk value: {compression_topk}")
    if not (isinstance(compression_chunk, int) and compression_chunk >= 1):
        raise ValueError(f"Invalid compression_chunk value: {compression_chunk}")
    value_codec(compression_bits)


UPDATES = ("sign", "adam", "rms", "linear")
# What the error feedback subtracts from the momentum: what the receivers dequantize (DeMo's rule:
# the quantization error stays in the momentum and is sent later), or the kept top-k values before
# quantization (Psyche's: the momentum forgets the kept coefficients whole).
FEEDBACKS = ("sent", "kept")
# torch.optim.AdamW's flags and their defaults, accepted so that a call written for AdamW works here
# unchanged. foreach and fused choose among torch's kernels; this optimizer's step has its own.
ADAMW_FLAGS = dict(
    amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None
)


def check_adamw_flags(group, local_steps: bool) -> None:
    """The AdamW flags (``ADAMW_FLAGS``) this optimizer cannot honour are refused, not ignored."""
    if group.get("capturable"):
        raise ValueError("capturable=True is not supported: a step that exchanges payloads between "
                         "workers cannot be captured in a CUDA graph")
    if group.get("differentiable"):
        raise ValueError("differentiable=True is not supported: top-k and quantization have no gradient")
    if group.get("amsgrad") and group["update"] != "adam" and not local_steps:
        raise ValueError(
            "amsgrad=True applies to update='adam' (or to the inner AdamW steps of sync_every > 1)"
        )


def check_error_feedback(error_feedback) -> None:
    if error_feedback not in FEEDBACKS:
        raise ValueError(f"Invalid error_feedback: {error_feedback!r} (expected one of {FEEDBACKS})")


def check_adamw_settings(betas, eps, update, outer_lr, outer_momentum) -> None:
    """torch-style validation of the settings DisTrOAdamW adds (``not 0.0 <= x``: NaN is rejected)."""
    for name, value in (("eps", eps), ("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
        check_number(name, value)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"Invalid betas: {betas!r} (expected a pair of numbers such as (0.9, 0.999))")
    for i, beta in enumerate(betas):
        check_number(f"betas[{i}]", beta)
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if update not in UPDATES:
        raise ValueError(f"Invalid update: {update!r} (expected one of {UPDATES})")
    if not 0.0 <= outer_lr:
        raise ValueError(f"Invalid outer_lr value: {outer_lr}")
    if not 0.0 <= outer_momentum < 1.0:
        raise ValueError(f"Invalid outer_momentum value: {outer_momentum}")


def check_params(params) -> None:
    """Parameters the step can compute on: real ones (a complex one would lose its imaginary part)."""
    complex_params = [tuple(p.shape) for p in params if p.is_complex()]
    if complex_params:
        raise ValueError(f"complex parameters are not supported (shapes {complex_params}): "
                         "pass torch.view_as_real views of them, or real parameters")
