"""Compression warm-up: lightly compressed first steps, then each group's own setting.

Methods that compress from the first step can lose what they never recover: PowerSGD (Vogels et
al. 2019) and 1-bit Adam (Tang et al. 2021) start with uncompressed steps, and Deep Gradient
Compression (Lin et al. 2018) ramps its sparsity up over the first epochs. ``CompressionWarmup``
is that idea for the optimizers here: for its first ``steps`` steps every param group sends its
top-``topk`` coefficients per chunk in ``bits`` bits, then each group goes back to its own
``compression_topk`` and ``compression_bits``. The payload's size follows, and the backend's byte
counters count what really travelled.

Use it like a torch learning-rate scheduler, on every worker alike (the workers' payload layouts
must agree at every step)::

    opt = DisTrOAdamW(model.parameters(), lr=4e-3)
    warmup = CompressionWarmup(opt, steps=30, topk=32, bits=2)
    for batch in data:
        loss(model, batch).backward()
        opt.step()
        warmup.step()
        opt.zero_grad()

In the local-step mode (``sync_every > 1``) ``steps`` counts optimizer steps, as the schedule of
the learning rate does: the syncs that fall within them are the lightly compressed ones.
"""
from __future__ import annotations

from .settings import check_hyperparameters

_KEYS = ("compression_topk", "compression_bits")


class CompressionWarmup:
    """The first ``steps`` optimizer steps at ``topk`` / ``bits`` (None: the group's own); see the
    module's docstring. ``steps=0`` changes nothing."""

    def __init__(self, optimizer, steps: int, topk: int | None = None, bits: int | None = None):
        if not (isinstance(steps, int) and steps >= 0):
            raise ValueError(f"Invalid warm-up steps: {steps!r} (expected an integer >= 0)")
        if topk is None and bits is None and steps > 0:
            raise ValueError("a compression warm-up needs topk or bits (else it would change nothing)")
        group = optimizer.param_groups[0]
        check_hyperparameters(
            group["lr"], group["weight_decay"], group["compression_decay"],
            group["compression_topk"] if topk is None else topk, group["compression_chunk"],
            group["compression_bits"] if bits is None else bits,
        )
        self.optimizer = optimizer
        self.steps = steps
        self.warmup = {"compression_topk": topk, "compression_bits": bits}
        # each group's own setting, restored when the warm-up ends
        self.own = [{k: g[k] for k in _KEYS} for g in optimizer.param_groups]
        self.last_step = 0
        self._apply()

    @property
    def active(self) -> bool:
        return self.last_step < self.steps

    def step(self) -> None:
        """Call once after every ``optimizer.step()``."""
        self.last_step += 1
        self._apply()

    def _apply(self) -> None:
        for group, own in zip(self.optimizer.param_groups, self.own):
            for key in _KEYS:
                warm = self.warmup[key]
                group[key] = warm if self.active and warm is not None else own[key]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "own": [dict(o) for o in self.own]}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the step count and each group's own setting (the optimizer's checkpoint holds
        the groups as they were at the save, which may be the warm-up's values)."""
        if len(state["own"]) != len(self.optimizer.param_groups):
            raise ValueError(
                f"compression warm-up state for {len(state['own'])} param groups, the optimizer has "
                f"{len(self.optimizer.param_groups)}"
            )
        self.last_step = int(state["last_step"])
        self.own = [{k: o[k] for k in _KEYS} for o in state["own"]]
        self._apply()
