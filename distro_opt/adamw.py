"""DisTrOAdamW: a drop-in for torch.optim.AdamW that exchanges a compressed decoupled momentum."""
from __future__ import annotations

import contextlib
import warnings

import torch

from .decoupled import DecoupledMomentumOptimizer, all_finite, check_hyperparameters
from .kept import kept_tensors

UPDATES = ("sign", "adam", "rms")
# torch.optim.AdamW's flags and their defaults, accepted so that a call written for AdamW works here
# unchanged. foreach and fused choose among torch's kernels; this optimizer's step has its own.
ADAMW_FLAGS = dict(
    amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None
)
# A group's settings that, in the local-step mode, are the inner optimizer's (where its groups have them)
INNER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def default_inner_optimizer(param_groups):
    """AdamW over the groups ``_inner_group`` makes (each group's params, lr, betas, eps and weight
    decay): the local-step mode's inner steps."""
    return torch.optim.AdamW(param_groups)


def _inner_group(group) -> dict:
    """A new dict of a group's parameters and INNER_KEYS for the inner optimizer: torch's optimizers
    keep the dict they are given and write their own defaults into it."""
    return {"params": list(group["params"]), **{k: group[k] for k in INNER_KEYS}}


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


def check_adamw_settings(betas, eps, update, outer_lr, outer_momentum) -> None:
    """torch-style validation of the settings DisTrOAdamW adds (``not 0.0 <= x``: NaN is rejected)."""
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


class DisTrOAdamW(DecoupledMomentumOptimizer):
    """AdamW's constructor, DeMo's communication (arXiv 2411.19870), Psyche's lean wire format.

    Per-step mode (``sync_every=1``, default), per parameter: ``Delta = compression_decay * Delta + g``
    in the chunked DCT domain; the top-``compression_topk`` coefficients per chunk are sent in
    ``compression_bits`` bits and subtracted (error feedback); U = IDCT(mean of what the workers
    sent) drives the update, after decoupled weight decay ``p *= 1 - lr * weight_decay``:

    * ``update="sign"`` (default): ``p -= lr * sign(U)``, DeMo's update. ``betas``/``eps`` unused.
    * ``update="rms"``: ``p -= lr * U / rms(U)``, the RMS taken over the tensor: the sign step's
      size, U's shape.
    * ``update="adam"``: ``m = b1 m + (1-b1) U``, ``v = b2 v + (1-b2) U^2``,
      ``p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``: AdamW's normalization of U.

    Local-step mode (``sync_every=H > 1``; DiLoCo, Douillard et al. 2023; SparseLoCo 2025): each
    worker takes H steps of ``inner_optimizer`` (AdamW with this optimizer's lr, betas, eps and
    weight decay by default) without communicating. At a sync the pseudo-gradient
    ``anchor - p`` (anchor = parameters at the last sync) goes through the same decayed error
    feedback, transform and codec; the aggregate G updates the anchor with an outer SGD step
    ``anchor -= outer_lr * (G + mu * m)``, ``m = mu * m + G`` (Nesterov when ``outer_momentum`` mu > 0),
    and every worker restarts from it. One collective per H steps.

    The inner groups take this optimizer's lr, betas, eps and weight_decay (those of the four they
    have) before every inner step, so schedules act on them; an ``inner_optimizer`` factory gets one
    new dict per group holding its params and these four, and ``add_param_group`` reaches the inner
    optimizer too. Under a GradScaler the inner steps take the unscaled gradients, and an overflow
    skips that inner step only: the sync still sends ``anchor - p``.

    The defaults (top-4 of each 64x64 chunk, 1-bit values with a bf16 magnitude per chunk) send
    8.5 bytes per 4096 parameters: 0.0021 bytes per parameter per step, as lean as Psyche's setting.

    AdamW's flags are accepted: ``maximize`` ascends; ``amsgrad`` keeps the largest second moment in
    ``update="adam"`` (and reaches the inner AdamW in the local-step mode); ``foreach`` and ``fused``
    are accepted and have no effect (this step has its own kernels); ``capturable=True`` and
    ``differentiable=True`` are refused.

    On the CPU the forward DCT of float32 matrices of 64x64 chunks runs in a C kernel where it was
    built (``distro_opt.native``). On the GEMM path (other chunks, or no kernel), on a CPU with bf16
    arithmetic, torch's process-wide ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` (the
    user's choice; never set here) also lets those GEMMs run in bf16: a faster step, each step's DCT
    of the gradient off by ~0.4%.
    """

    _optional_group_keys = tuple(ADAMW_FLAGS)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        compression_decay: float = 0.999,
        compression_topk: int = 4,
        compression_chunk: int = 64,
        compression_bits: int = 1,
        update: str = "sign",
        sync_every: int = 1,
        inner_optimizer=None,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        comm=None,
        overlap: bool = False,
    ):
        check_hyperparameters(lr, weight_decay, compression_decay, compression_topk, compression_chunk, compression_bits)
        check_adamw_settings(betas, eps, update, outer_lr, outer_momentum)
        if not (isinstance(sync_every, int) and sync_every >= 1):
            raise ValueError(f"Invalid sync_every value: {sync_every}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, compression_decay=compression_decay,
            compression_topk=compression_topk, compression_chunk=compression_chunk,
            compression_bits=compression_bits, update=update, outer_lr=outer_lr, outer_momentum=outer_momentum,
            amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
        )
        self._inner = None  # read by add_param_group, which torch's constructor calls
        self.sync_every = sync_every  # read by _check_group, which it calls too
        super().__init__(params, defaults, comm=comm, overlap=overlap)
        if sync_every > 1:
            if overlap:
                raise ValueError("overlap=True applies to the per-step mode only (sync_every=1)")
            self._skip_empty_steps = False  # a sync resets every worker to the anchor, contributions or not
            make = inner_optimizer or default_inner_optimizer
            inner = make([_inner_group(g) for g in self.param_groups])
            if len(inner.param_groups) != len(self.param_groups):
                raise ValueError(
                    f"inner_optimizer has {len(inner.param_groups)} parameter groups, expected "
                    f"{len(self.param_groups)} (one per group of this optimizer, in order)"
                )
            self._inner = inner

    def _check_group(self, group) -> None:
        super()._check_group(group)
        check_adamw_settings(
            group["betas"], group["eps"], group["update"], group["outer_lr"], group["outer_momentum"]
        )
        check_adamw_flags(group, local_steps=self.sync_every > 1)

    def add_param_group(self, param_group) -> None:
        """As torch's, validated like the constructor's groups; in the local-step mode the inner
        optimizer, which takes the new parameters' steps, gets the group too."""
        super().add_param_group(param_group)
        if self._inner is not None:
            self._inner.add_param_group(_inner_group(self.param_groups[-1]))

    def _momentum_scale(self, group):
        """-1 under ``maximize`` (the gradient's ascent); in the local-step mode the inner optimizer
        takes ``maximize`` and the pseudo-gradient already points the right way."""
        return -1.0 if group["maximize"] and self._inner is None else 1.0

    def _input_unscale(self) -> float:
        """The pseudo-gradient ``anchor - p`` is in the parameters' units: the loss scale was taken
        out of the gradients before each inner step (``_inner_step``)."""
        return 1.0 if self._inner is not None else super()._input_unscale()

    def _scaler_found_inf(self) -> bool:
        """In the local-step mode a GradScaler overflow skips only that inner step (``_inner_step``);
        the sync still sends what the interval's other steps did."""
        return False if self._inner is not None else super()._scaler_found_inf()

    # -- local-step mode ---------------------------------------------------------------------------
    def _communicates_this_step(self, entries) -> bool:
        if self._inner is None:
            return True
        with kept_tensors():  # the anchors and the inner optimizer's state outlive the step
            for _, p in entries:
                if "anchor" not in self.state[p]:
                    self.state[p]["anchor"] = p.detach().to(self._work_dtype(p), copy=True)
            skipped = self._inner_step([p.grad for _, p in entries if p.grad is not None])
        if skipped:
            warnings.warn(f"distro-opt: {skipped}; this inner step is skipped")
        local = self.state["local_step"] = self.state.get("local_step", 0) + 1
        return local % self.sync_every == 0

    def _inner_step(self, grads):
        """One step of the inner optimizer, on unscaled finite gradients, with this optimizer's
        current settings (schedulers act on its groups); returns why it was skipped, or None.

        GradScaler leaves the unscaling to this optimizer (``_step_supports_amp_scaling``): it sets
        ``grad_scale`` (None after the user's own ``unscale_``) and ``found_inf`` for the step."""
        if self._scaler_overflowed():
            return "GradScaler found inf/NaN gradients"
        unscale = super()._input_unscale()  # the loss scale's inverse (this class's own is 1 here)
        if unscale != 1.0 and grads:
            torch._foreach_mul_(grads, unscale)
        if not all_finite(grads):
            return "non-finite local gradient"
        for inner, outer in zip(self._inner.param_groups, self.param_groups):
            inner.update({k: outer[k] for k in INNER_KEYS if k in inner})
        self._inner.step()
        return None

    def _inputs(self, entries):
        if self._inner is None:
            return super()._inputs(entries)
        return [self.state[p]["anchor"] - p.detach().to(self.state[p]["anchor"].dtype) for _, p in entries]

    @contextlib.contextmanager
    def synced_parameters(self):
        """Within the block every parameter holds the model all workers agree on; on exit each gets
        its own value back, bit for bit.

        In the local-step mode that is the anchor: the parameters of the last sync, after its outer
        update (before the first sync: the starting point). Between syncs each worker's parameters
        drift toward its own data, so evaluate or export the global model inside this block::

            with opt.synced_parameters():
                val_loss = evaluate(model)

        In the per-step mode the workers' parameters are already identical and there is no anchor:
        nothing changes. Reading the state adds no entry to it (``self.state`` is a defaultdict).
        """
        swapped = []
        params = [p for g in self.param_groups for p in g["params"]]  # frozen ones too: they drifted before
        with torch.no_grad():
            for p in params:
                anchor = self.state.get(p, {}).get("anchor")
                if anchor is not None:
                    swapped.append((p, p.detach().clone()))
                    p.copy_(anchor)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, local in swapped:
                    p.copy_(local)

    def _apply(self, entries, layout, decoded):
        super()._apply(entries, layout, decoded)
        if self._inner is not None:  # a sync: every worker restarts from the anchor, frozen parameters too
            trained = {id(p) for _, p in entries}
            for group in self.param_groups:
                for p in group["params"]:
                    anchor = self.state.get(p, {}).get("anchor")
                    if anchor is not None and id(p) not in trained:
                        p.copy_(anchor)  # frozen mid-interval: its local steps since then are dropped

    def _outer_update(self, group, p, direction, state):
        mu = group["outer_momentum"]
        if mu > 0:
            if "outer_momentum_buffer" not in state:
                with kept_tensors():
                    buffer = torch.zeros(p.shape, dtype=direction.dtype, device=p.device)
                state["outer_momentum_buffer"] = buffer
            m = self._view(state["outer_momentum_buffer"], direction)
            m.mul_(mu).add_(direction)
            direction = direction + mu * m
        anchor = self._view(state["anchor"], direction)
        anchor.add_(direction, alpha=-group["outer_lr"])
        self._view(p, direction).copy_(anchor)

    def state_dict(self):
        sd = super().state_dict()
        if self._inner is not None:
            sd["inner"] = self._inner.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        inner = state_dict.pop("inner", None)
        if (inner is None) != (self._inner is None):
            raise ValueError("checkpoint and optimizer disagree on the local-step mode (sync_every)")
        if inner is not None:  # torch would refuse it only after this optimizer's state was replaced
            saved = [len(g["params"]) for g in inner["param_groups"]]
            expected = [len(g["params"]) for g in self._inner.param_groups]
            if saved != expected:
                raise ValueError(
                    f"checkpoint's inner optimizer has groups of {saved} parameters, expected {expected}"
                )
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # checkpoints saved before the flags existed
            for key, value in ADAMW_FLAGS.items():
                group.setdefault(key, value)
        if inner is not None:
            self._inner.load_state_dict(inner)

    # -- the update --------------------------------------------------------------------------------
    @staticmethod
    def _rms_step(group, p, direction):
        """p -= lr * U / rms(U) over the tensor: the sign step's size (its RMS is 1 too) with U's own
        shape kept. A tensor nobody sent anything for (U = 0) does not move."""
        rms = torch.linalg.vector_norm(direction) / direction.numel() ** 0.5
        direction.div_(rms.clamp_min(torch.finfo(direction.dtype).tiny))
        p.add_(direction.to(p.dtype), alpha=-group["lr"])

    def _update(self, group, p, direction, state):
        if self._inner is not None:
            return self._outer_update(group, p, direction, state)
        target = self._view(p, direction)
        self._weight_decay(group, p)  # on p itself: a contiguous pass is cheaper than the blocked view
        if group["update"] == "sign":
            return self._sign_step(group, target, direction)
        if group["update"] == "rms":
            return self._rms_step(group, target, direction)
        if "exp_avg" not in state:
            with kept_tensors():
                state["exp_avg"] = torch.zeros(p.shape, dtype=direction.dtype, device=p.device)
                state["exp_avg_sq"] = torch.zeros(p.shape, dtype=direction.dtype, device=p.device)
        beta1, beta2 = group["betas"]
        t = float(state["step"])
        m, v = self._view(state["exp_avg"], direction), self._view(state["exp_avg_sq"], direction)
        m.lerp_(direction, 1 - beta1)
        v.mul_(beta2).addcmul_(direction, direction, value=1 - beta2)
        if group["amsgrad"]:  # the largest second moment so far, as torch's AdamW(amsgrad=True)
            if "max_exp_avg_sq" not in state:
                with kept_tensors():
                    state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=direction.dtype, device=p.device)
            v_max = self._view(state["max_exp_avg_sq"], direction)
            v = torch.maximum(v_max, v, out=v_max)
        denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        if p.dtype == denom.dtype:
            target.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**t))
        else:  # the ratio in the momentum's dtype: eps (1e-8) is 0 in float16, and 0 / 0 is NaN
            target.add_((m / denom).to(p.dtype), alpha=-group["lr"] / (1 - beta1**t))
