"""The update rules: how the aggregated direction U moves a parameter (stage 10 of ``step.py``).

Each rule is a small object: ``rule.apply(group, params, Us, states)`` updates the tensors of one
param group, ``rule(group, p, U, state)`` one of them. ``group`` holds the numbers (lr, betas, ...),
``state`` is ``optimizer.state[p]``, and U comes in the transform's blocked layout, which
``p.view(U.shape)`` lines up with element for element (``DCTTransform.inverse_sparse_pieces``). The
per-step rules first apply decoupled weight decay, ``p *= 1 - lr * weight_decay`` (Loshchilov &
Hutter 2019), through the optimizer's ``WeightDecay``. The sign and Adam rules update a whole group
with torch's foreach ops (a few kernels for all of its tensors instead of several per tensor: on a
GPU the step is bound by the host's launches); the others go tensor by tensor.

* ``SignUpdate``: ``p -= lr * sign(U)``, DeMo's update.
* ``RmsUpdate``: ``p -= lr * U / rms(U)``, the RMS over the tensor: the sign step's size, U's shape.
* ``LinearUpdate``: ``p -= lr * U``, for an already normalized momentum (``precondition="adam"``).
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
        self.apply(group, [p])

    def apply(self, group, params) -> None:
        """Decay every tensor of ``params`` (of one group): one foreach multiply per device and
        dtype for float32 and float64 tensors."""
        if group["weight_decay"] == 0:
            return
        factor = 1 - group["lr"] * group["weight_decay"]
        kinds: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            kinds.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), tensors in kinds.items():
            if dtype not in (torch.float32, torch.float64) or (device.type != "cpu" and isinstance(factor, torch.Tensor)):
                # tensor by tensor: torch's foreach multiply rounds the number to a bf16 or float16
                # tensor's dtype first (``mul_`` does not), and a tensor lr may live on another device
                for p in tensors:
                    p.mul_(factor)
            elif device.type == "cpu":
                torch._foreach_mul_(tensors, self._cpu_factor(group, factor, dtype))
            else:
                torch._foreach_mul_(tensors, factor)

    def _cpu_factor(self, group, factor, dtype) -> torch.Tensor:
        if isinstance(factor, torch.Tensor):  # a tensor lr (on the CPU here): its value, once
            factor = factor.item()
        key = (id(group), dtype)  # one per group: groups' factors differ; the value is checked
        cached = self._factors.get(key)
        if cached is None or cached[0] != factor:
            if len(self._factors) > self.MAX_CACHED:
                self._factors.clear()
            with torch.inference_mode(False):
                tensor = torch.tensor(factor, dtype=dtype)
            cached = self._factors[key] = (factor, tensor)
        return cached[1]


def _zeros_like_param(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode(False):  # optimizer state: an ordinary tensor that outlives the step
        return torch.zeros(p.shape, dtype=dtype, device=p.device)


class UpdateRule:
    """What every rule offers: ``apply`` on one group's tensors, tensor by tensor unless the rule does
    better, and ``rule(group, p, U, state)`` on one tensor."""

    def apply(self, group, params, directions, states) -> None:
        for p, direction, state in zip(params, directions, states):
            self(group, p, direction, state)

    def __call__(self, group, p, direction, state) -> None:
        raise NotImplementedError


class DecayingRule(UpdateRule):
    """A per-step rule, which applies the optimizer's decoupled weight decay first."""

    def __init__(self, weight_decay: WeightDecay):
        self.weight_decay = weight_decay


class LinearUpdate(DecayingRule):
    """p -= lr * U: the aggregate as it is, for a momentum that is already normalized
    (``precondition="adam"``). A group's tensors are updated together, with foreach ops."""

    def __call__(self, group, p, direction, state) -> None:
        self.apply(group, [p], [direction], [state])

    def apply(self, group, params, directions, states) -> None:
        # the weight decay on p itself: a contiguous pass is cheaper than the blocked view
        self.weight_decay.apply(group, params)
        targets = [p.view(d.shape) for p, d in zip(params, directions)]
        torch._foreach_add_(targets, [as_dtype(d, p.dtype) for p, d in zip(params, directions)], alpha=-group["lr"])


class SignUpdate(LinearUpdate):
    """DeMo's update: p -= lr * sign(U), the linear step of U's sign. U is this step's own scratch:
    its sign is taken in place. A group's tensors are updated together, with foreach ops."""

    def apply(self, group, params, directions, states) -> None:
        torch._foreach_sign_(directions)
        super().apply(group, params, directions, states)


class RmsUpdate(DecayingRule):
    """p -= lr * U / rms(U) over the tensor: the sign step's size (its RMS is 1 too) with U's own
    shape kept. A tensor nobody sent anything for (U = 0) does not move."""

    def __call__(self, group, p, direction, state) -> None:
        target = p.view(direction.shape)
        self.weight_decay(group, p)
        rms = torch.linalg.vector_norm(direction) / direction.numel() ** 0.5
        direction.div_(rms.clamp_min(torch.finfo(direction.dtype).tiny))
        target.add_(direction.to(p.dtype), alpha=-group["lr"])


class AdamUpdate(DecayingRule):
    """AdamW's normalization of U: ``m = b1 m + (1-b1) U``, ``v = b2 v + (1-b2) U^2``,
    ``p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``; with ``amsgrad`` the largest v so far,
    as torch's AdamW(amsgrad=True). The moments live in ``state`` in the momentum's dtype."""

    def __call__(self, group, p, direction, state) -> None:
        self.apply(group, [p], [direction], [state])

    def apply(self, group, params, directions, states) -> None:
        """One group's tensors together, with foreach ops (the step count t may differ by tensor)."""
        self.weight_decay.apply(group, params)
        beta1, beta2 = group["betas"]
        for p, d, state in zip(params, directions, states):
            if "exp_avg" not in state:
                state["exp_avg"] = _zeros_like_param(p, d.dtype)
                state["exp_avg_sq"] = _zeros_like_param(p, d.dtype)
            if group["amsgrad"] and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = _zeros_like_param(p, d.dtype)
        ms = [st["exp_avg"].view(d.shape) for st, d in zip(states, directions)]
        vs = [st["exp_avg_sq"].view(d.shape) for st, d in zip(states, directions)]
        torch._foreach_lerp_(ms, directions, 1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, directions, directions, value=1 - beta2)
        if group["amsgrad"]:
            v_maxes = [st["max_exp_avg_sq"].view(d.shape) for st, d in zip(states, directions)]
            torch._foreach_maximum_(v_maxes, vs)
            vs = v_maxes
        ts = [float(st["step"]) for st in states]
        denoms = torch._foreach_div(vs, [1 - beta2**t for t in ts])
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, group["eps"])
        lr = group["lr"]
        targets = [p.view(d.shape) for p, d in zip(params, directions)]
        if not isinstance(lr, torch.Tensor) and all(p.dtype == d.dtype for p, d in zip(params, denoms)):
            torch._foreach_addcdiv_(targets, ms, denoms, [-lr / (1 - beta1**t) for t in ts])
            return
        for p, target, m, denom, t in zip(params, targets, ms, denoms, ts):
            if p.dtype == denom.dtype:
                target.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
            else:  # the ratio in the momentum's dtype: eps (1e-8) is 0 in float16, and 0 / 0 is NaN
                target.add_((m / denom).to(p.dtype), alpha=-lr / (1 - beta1**t))


class OuterUpdate(UpdateRule):
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
