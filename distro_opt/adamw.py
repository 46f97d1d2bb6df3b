"""DisTrOAdamW: a drop-in for torch.optim.AdamW that exchanges a compressed decoupled momentum."""
from __future__ import annotations

import torch

from .decoupled import DecoupledMomentumOptimizer, check_hyperparameters

UPDATES = ("sign", "adam")


class DisTrOAdamW(DecoupledMomentumOptimizer):
    """AdamW's constructor, DeMo's communication (arXiv 2411.19870), Psyche's lean wire format.

    Per step and parameter: ``Delta = compression_decay * Delta + g`` in the chunked DCT domain; the
    top-``compression_topk`` coefficients per chunk are sent in ``compression_bits`` bits and
    subtracted (error feedback); the aggregate U = IDCT(mean of what the workers sent) drives the
    update, after decoupled weight decay ``p *= 1 - lr * weight_decay``:

    * ``update="sign"`` (default): ``p -= lr * sign(U)``, DeMo's update. ``betas``/``eps`` unused.
    * ``update="adam"``: ``m = b1 m + (1-b1) U``, ``v = b2 v + (1-b2) U^2``,
      ``p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``: AdamW's normalization of U.

    The defaults (top-4 of each 64x64 chunk, 1-bit values with a bf16 magnitude per chunk) send
    8.5 bytes per 4096 parameters: 0.0021 bytes per parameter per step, as lean as Psyche's setting.

    Args follow ``torch.optim.AdamW``; the keyword-only ones are distro-opt's (see ``DeMo``) plus
    ``update`` ("sign" or "adam").
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        compression_decay: float = 0.999,
        compression_topk: int = 4,
        compression_chunk: int = 64,
        compression_bits: int = 1,
        update: str = "sign",
        comm=None,
        overlap: bool = False,
    ):
        check_hyperparameters(lr, weight_decay, compression_decay, compression_topk, compression_chunk, compression_bits)
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if update not in UPDATES:
            raise ValueError(f"Invalid update: {update!r} (expected one of {UPDATES})")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            compression_decay=compression_decay,
            compression_topk=compression_topk,
            compression_chunk=compression_chunk,
            compression_bits=compression_bits,
            update=update,
        )
        super().__init__(params, defaults, comm=comm, overlap=overlap)

    def _momentum_scale(self, group):
        return 1.0

    def _update(self, group, p, direction, state):
        if group["update"] == "sign":
            p.add_(direction.sign().to(p.dtype), alpha=-group["lr"])
            return
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(direction)
            state["exp_avg_sq"] = torch.zeros_like(direction)
        beta1, beta2 = group["betas"]
        t = float(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(direction, 1 - beta1)
        v.mul_(beta2).addcmul_(direction, direction, value=1 - beta2)
        denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-group["lr"] / (1 - beta1**t))
