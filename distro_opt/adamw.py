"""DisTrOAdamW: a drop-in for torch.optim.AdamW that exchanges a compressed decoupled momentum."""
from __future__ import annotations

from .local_steps import LocalSteps, default_inner_optimizer, inner_group, synced_parameters
from .optimizer import DecoupledMomentumOptimizer
from .settings import (
    ADAMW_FLAGS, check_adamw_flags, check_adamw_settings, check_error_feedback, check_hyperparameters,
)
from .precondition import check_precondition, default_rule
from .updates import AdamUpdate, LinearUpdate, OuterUpdate, RmsUpdate, SignUpdate

class DisTrOAdamW(DecoupledMomentumOptimizer):
    """AdamW's constructor, DeMo's communication (arXiv 2411.19870), Psyche's lean wire format.

    Per-step mode (``sync_every=1``, default), per parameter: ``Delta = compression_decay * Delta + x``
    in the chunked DCT domain, x the momentum's input (below); the top-``compression_topk``
    coefficients per chunk are sent in ``compression_bits`` bits and subtracted (error feedback);
    U = IDCT(mean of what the workers sent) drives the update, after decoupled weight decay
    ``p *= 1 - lr * weight_decay``.

    The defaults: ``precondition="adam"``, ``update="linear"``, top-4 of each 16x16 chunk.
    ``precondition="adam"`` feeds the momentum each worker's gradient divided by the root of its own
    second moment, ``x = g / (sqrt(v_hat) + eps)`` with ``v = b2 v + (1-b2) g^2`` (b2 = ``betas[1]``;
    v never travels), as 1-bit Adam compresses an Adam-normalized momentum; ``"none"``: x = g.
    The update:

    * ``update="linear"``: ``p -= lr * U``, the aggregate as it is (the default, with the preconditioner).
    * ``update="sign"``: ``p -= lr * sign(U)``, DeMo's update (the default where
      ``precondition="none"``; ``update="sign"`` alone is DeMo's rule with its 64x64 chunks).
    * ``update="rms"``: ``p -= lr * U / rms(U)``, the RMS taken over the tensor: the sign step's
      size, U's shape.
    * ``update="adam"``: ``m = b1 m + (1-b1) U``, ``v = b2 v + (1-b2) U^2``,
      ``p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``: AdamW's normalization of U.

    An update given without ``precondition`` other than ``"linear"`` runs without the
    preconditioner; ``compression_chunk`` left out is 16 with it and 64 without it. The
    preconditioner and the 16x16 chunks are the defaults because they keep most of the
    data-parallel gain where DeMo's rule at 64x64 keeps little or none (docs/results-workers.md);
    they send 6.5 bytes per 256 parameters (four 1-byte indices, four 1-bit values, a bf16
    magnitude): 77.9x fewer bytes than a bf16 gradient, 12x DeMo's 8.5 bytes per 4096. Their best
    lr was 1e-3 with 4 workers, 5e-4 with 16 (AdamW's: 4e-3).

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

    ``error_feedback`` says what the momentum loses when its top-k is sent: ``"sent"`` (default,
    DeMo's rule) subtracts the values as the receivers dequantize them, so the quantization error
    stays in the momentum and is sent later; ``"kept"`` (Psyche's rule) subtracts the kept values
    before quantization, so the momentum forgets those coefficients whole.

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

    _optional_group_keys = (*ADAMW_FLAGS, "precondition")

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
        compression_chunk: int | None = None,
        compression_bits: int = 1,
        update: str | None = None,
        precondition: str | None = None,
        error_feedback: str = "sent",
        sync_every: int = 1,
        inner_optimizer=None,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        comm=None,
        overlap: bool = False,
    ):
        if not (isinstance(sync_every, int) and sync_every >= 1):
            raise ValueError(f"Invalid sync_every value: {sync_every}")
        precondition, update, compression_chunk = default_rule(precondition, update, compression_chunk, sync_every)
        check_hyperparameters(lr, weight_decay, compression_decay, compression_topk, compression_chunk, compression_bits)
        check_adamw_settings(betas, eps, update, outer_lr, outer_momentum)
        check_error_feedback(error_feedback)
        check_precondition(precondition, sync_every)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, compression_decay=compression_decay,
            compression_topk=compression_topk, compression_chunk=compression_chunk,
            compression_bits=compression_bits, update=update, precondition=precondition, outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
        )
        self.error_feedback = error_feedback
        self.sync_every = sync_every  # read by _check_group, which torch's constructor calls
        super().__init__(params, defaults, comm=comm, overlap=overlap)
        weight_decay_rule = self._weight_decay
        self._rules = {
            "sign": SignUpdate(weight_decay_rule), "rms": RmsUpdate(weight_decay_rule),
            "adam": AdamUpdate(weight_decay_rule), "linear": LinearUpdate(weight_decay_rule),
            "outer": OuterUpdate(),
        }
        if sync_every > 1:
            if overlap:
                raise ValueError("overlap=True applies to the per-step mode only (sync_every=1)")
            make = inner_optimizer or default_inner_optimizer
            inner = make([inner_group(g) for g in self.param_groups])
            self._source = LocalSteps(inner, sync_every, len(self.param_groups))

    def _check_group(self, group) -> None:
        super()._check_group(group)
        check_adamw_settings(
            group["betas"], group["eps"], group["update"], group["outer_lr"], group["outer_momentum"]
        )
        check_adamw_flags(group, local_steps=self.sync_every > 1)
        check_precondition(group.get("precondition", "none"), self.sync_every)

    @property
    def inner_optimizer(self):
        """The local-step mode's inner optimizer (None in the per-step mode)."""
        return self._source.inner_optimizer

    def _momentum_scale(self, group):
        """-1 under ``maximize`` (the gradient's ascent); in the local-step mode the inner optimizer
        takes ``maximize`` and the pseudo-gradient already points the right way."""
        return -1.0 if group["maximize"] and self.sync_every == 1 else 1.0

    def _update_rule(self, group):
        return self._rules["outer" if self.sync_every > 1 else group["update"]]

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
        return synced_parameters(self.param_groups, self.state)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # checkpoints that lack the AdamW flags get their defaults
            for key, value in ADAMW_FLAGS.items():
                group.setdefault(key, value)
            group.setdefault("precondition", "none")
