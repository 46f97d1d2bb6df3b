"""The update rules: how the aggregated direction U moves a parameter (stage 10 of ``step.py``).

Each rule is a small object called as ``rule(group, p, U, state)``: ``group`` holds the numbers
(lr, betas, ...), ``state`` is ``optimizer.state[p]``, and U comes in the transform's blocked layout,
which ``p.view(U.shape)`` lines up with element for element (``DCTTransform.inverse_sparse_pieces``). The
per-step rules first apply decoupled weight decay, ``p *= 1 - lr * weight_decay`` (Loshchilov &
Hutter 2019), through the optimizer's ``WeightDecay``.

* ``SignUpdate``: ``p -= lr * sign(U)``, DeMo's update.
* ``RmsUpdate``: ``p -= lr * U / rms(U)``, the RMS over the tensor: the sign step's size, U's shape.
* ``AdamUpdate``: AdamW's moments of U (Kingma & Ba 2015), ``p -= lr * m_hat / (sqrt(v_hat) + eps)``.
* ``OuterUpdate``: the local-step mode's outer SGD step on the anchor (DiLoCo, Douillard et al. 2023),
  ``anchor -= outer_lr * (U + mu * m)``, ``m = mu * m + U`` (Nesterov when mu > 0); p restarts there.
"""
from __future__ import annotations

import torch

from .step import as_dtype


class WeightDecay:
    """Decoupled weight decay, ``p *= 1 - lr * wd`` (skipped when wd = 0: no pass over p).

    On the CPU, for float32 and float64, p is multiplied by a 0-d tensor of its dtype made once per
    value: the same product (torch multiplies by a number in p's dtype too) without the tensor torch
    would wrap around a number on every call. Other dtypes multiply by the number; on a GPU a number
    travels with the kernel, while a new 0-d tensor (a schedule changes the lr every step) would be
    a copy that waits for the device."""

    MAX_CACHED = 256  # the overlap mode passes a copy of each group per step: the cache is bounded

    def __init__(self):
        self._factors: dict[tuple, tuple[float, torch.Tensor]] = {}

    def __call__(self, group, p: torch.Tensor) -> None:
        if group["weight_decay"] == 0:
            return
        factor = 1 - group["lr"] * group["weight_decay"]
        if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.float64):
            p.mul_(factor)
            return
        if isinstance(factor, torch.Tensor):  # a tensor lr (on the CPU here): its value, once
            factor = factor.item()
        key = (id(group), p.dtype)  # one per group: groups' factors differ; the value is checked
        cached = self._factors.get(key)
        if cached is None or cached[0] != factor:
            if len(self._factors) > self.MAX_CACHED:
                self._factors.clear()
            with torch.inference_mode(False):
                tensor = torch.tensor(factor, dtype=p.dtype)
            cached = self._factors[key] = (factor, tensor)
        p.mul_(cached[1])


def _zeros_like_param(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode(False):  # optimizer state: an ordinary tensor that outlives the step
        return torch.zeros(p.shape, dtype=dtype, device=p.device)


class SignUpdate:
    """DeMo's update: p -= lr * sign(U). U is this step's own scratch: its sign is taken in place."""

    def __init__(self, weight_decay: WeightDecay):
        self.weight_decay = weight_decay

    def __call__(self, group, p, direction, state) -> None:
        target = p.view(direction.shape)
        self.weight_decay(group, p)  # on p itself: a contiguous pass is cheaper than the blocked view
        target.add_(as_dtype(direction.sign_(), p.dtype), alpha=-group["lr"])


class RmsUpdate(SignUpdate):
    """p -= lr * U / rms(U) over the tensor: the sign step's size (its RMS is 1 too) with U's own
    shape kept. A tensor nobody sent anything for (U = 0) does not move."""

    def __call__(self, group, p, direction, state) -> None:
        target = p.view(direction.shape)
        self.weight_decay(group, p)
        rms = torch.linalg.vector_norm(direction) / direction.numel() ** 0.5
        direction.div_(rms.clamp_min(torch.finfo(direction.dtype).tiny))
        target.add_(direction.to(p.dtype), alpha=-group["lr"])


class AdamUpdate(SignUpdate):
    """AdamW's normalization of U: ``m = b1 m + (1-b1) U``, ``v = b2 v + (1-b2) U^2``,
    ``p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``; with ``amsgrad`` the largest v so far,
    as torch's AdamW(amsgrad=True). The moments live in ``state`` in the momentum's dtype."""

    def __call__(self, group, p, direction, state) -> None:
        target = p.view(direction.shape)
        self.weight_decay(group, p)
        if "exp_avg" not in state:
            state["exp_avg"] = _zeros_like_param(p, direction.dtype)
            state["exp_avg_sq"] = _zeros_like_param(p, direction.dtype)
        beta1, beta2 = group["betas"]
        t = float(state["step"])
        m, v = state["exp_avg"].view(direction.shape), state["exp_avg_sq"].view(direction.shape)
        m.lerp_(direction, 1 - beta1)
        v.mul_(beta2).addcmul_(direction, direction, value=1 - beta2)
        if group["amsgrad"]:
            if "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = _zeros_like_param(p, direction.dtype)
            v_max = state["max_exp_avg_sq"].view(direction.shape)
            v = torch.maximum(v_max, v, out=v_max)
        denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        if p.dtype == denom.dtype:
            target.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**t))
        else:  # the ratio in the momentum's dtype: eps (1e-8) is 0 in float16, and 0 / 0 is NaN
            target.add_((m / denom).to(p.dtype), alpha=-group["lr"] / (1 - beta1**t))


class OuterUpdate:
    """The outer step of the local-step mode, on ``state["anchor"]`` (the parameters of the last
    sync), after which p restarts from the anchor. No weight decay here: the inner steps apply it."""

    def __call__(self, group, p, direction, state) -> None:
        mu = group["outer_momentum"]
        if mu > 0:
            if "outer_momentum_buffer" not in state:
                state["outer_momentum_buffer"] = _zeros_like_param(p, direction.dtype)
            m = state["outer_momentum_buffer"].view(direction.shape)
            m.mul_(mu).add_(direction)
            direction = direction + mu * m
        anchor = state["anchor"].view(direction.shape)
        anchor.add_(direction, alpha=-group["outer_lr"])
        p.view(direction.shape).copy_(anchor)
