"""What feeds the momentum: each step's gradients, or every H steps a pseudo-gradient.

An optimizer holds one of these *input sources*; the step (``optimizer.py``, ``step.py``) asks it,
without knowing which it has, whether this step communicates, what the inputs are, and what to do
after the update.

* ``GradientInputs`` (per-step mode): every step communicates; the input is each gradient, with
  GradScaler's loss scale taken out; an overflow makes this worker contribute nothing.
* ``LocalSteps`` (``sync_every=H > 1``; DiLoCo, Douillard et al. 2023; SparseLoCo 2025): each worker
  takes H steps of an inner optimizer without communicating; at a sync the input is the
  pseudo-gradient ``anchor - p`` (anchor = the parameters at the last sync), the outer step
  (``updates.OuterUpdate``) moves the anchor, and every worker restarts from it.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from .shards import from_per_replica, like_param, local, per_replica
from .step import all_finite, momentum_state, work_dtype

# A group's settings that, in the local-step mode, are the inner optimizer's (where its groups have them)
INNER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def loss_unscale(opt) -> float:
    """The inverse of GradScaler's loss scale: GradScaler sets ``grad_scale`` (None after the user's
    own ``unscale_``) on an optimizer with ``_step_supports_amp_scaling``; 1.0 without one."""
    grad_scale = getattr(opt, "grad_scale", None)
    return 1.0 if grad_scale is None else 1.0 / float(grad_scale)


def scaler_overflowed(opt) -> bool:
    """Whether GradScaler found inf/NaN in this step's gradients (it sets ``found_inf`` as it sets
    ``grad_scale``)."""
    found_inf = getattr(opt, "found_inf", None)
    return found_inf is not None and float(found_inf) > 0


class GradientInputs:
    """The per-step mode's source: the gradients. Stateless."""

    inner_optimizer = None
    skips_empty_steps = True  # a step nobody contributed to is skipped on every worker alike

    def communicates(self, opt, entries) -> bool:
        return True

    def inputs(self, opt, entries) -> list[torch.Tensor | None]:
        return [p.grad for _, p in entries]

    def unscale(self, opt) -> float:
        return loss_unscale(opt)

    def contributes(self, opt) -> bool:
        """False after a GradScaler overflow: this worker then sends an empty payload (skipping the
        step on one worker alone would leave the others waiting in the collective)."""
        if scaler_overflowed(opt):
            warnings.warn("distro-opt: GradScaler found inf/NaN gradients; this worker contributes nothing this step")
            return False
        return True

    def after_update(self, opt, entries) -> None:
        pass

    def add_param_group(self, group) -> None:
        pass

    def save(self, opt, sd: dict) -> None:
        pass

    def take_from(self, sd: dict):
        """Refuse a local-step checkpoint; nothing of its own to take."""
        if is_local_step_checkpoint(sd):
            raise ValueError(MODE_MISMATCH)
        return None

    def finish_load(self, opt, taken) -> None:
        pass


GRADIENTS = GradientInputs()
MODE_MISMATCH = "checkpoint and optimizer disagree on the local-step mode (sync_every)"
INNER_PREFIX = "inner."  # a parameter's inner-optimizer state, saved in its own state under this prefix


def is_local_step_checkpoint(sd: dict) -> bool:
    """Whether ``sd`` was saved in the local-step mode: its groups count the local steps, or (the
    layout before that) it holds the inner optimizer's state dict and counts in ``state``."""
    return "inner" in sd or any("local_step" in g for g in sd.get("param_groups", []))


def inner_group(group) -> dict:
    """A new dict of a group's parameters and INNER_KEYS for the inner optimizer: torch's optimizers
    keep the dict they are given and write their own defaults into it."""
    return {"params": list(group["params"]), **{k: group[k] for k in INNER_KEYS}}


def default_inner_optimizer(param_groups):
    """AdamW over the groups ``inner_group`` makes: the local-step mode's inner steps."""
    return torch.optim.AdamW(param_groups)


class LocalSteps:
    """The local-step mode's source: ``sync_every`` inner steps, then one sync of ``anchor - p``.

    The inner groups take the outer groups' INNER_KEYS before every inner step, so schedules act on
    them. Under a GradScaler the inner steps take the unscaled gradients and an overflow skips that
    inner step only: the sync still sends what the interval's other steps did."""

    skips_empty_steps = False  # a sync resets every worker to the anchor, contributions or not

    def __init__(self, inner_optimizer, sync_every: int, num_groups: int):
        if len(inner_optimizer.param_groups) != num_groups:
            raise ValueError(
                f"inner_optimizer has {len(inner_optimizer.param_groups)} parameter groups, expected "
                f"{num_groups} (one per group of this optimizer, in order)"
            )
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.count = 0  # local steps taken

    def communicates(self, opt, entries) -> bool:
        """Take one inner step; True on every ``sync_every``-th."""
        with torch.inference_mode(False):  # the anchors and the inner optimizer's state outlive the step
            for _, p in entries:
                if "anchor" not in opt.state[p]:
                    opt.state[p]["anchor"] = p.detach().to(work_dtype(p), copy=True)
                    # the momentum too, before the first sync: a checkpoint then has the state's
                    # whole shape (torch.distributed.checkpoint loads only what its target has)
                    opt.state[p]["delta"] = like_param(momentum_state({}, local(p))["delta"], p)
                    opt.state[p].setdefault("step", torch.tensor(0.0))
            skipped = self._inner_step(opt, [p.grad for _, p in entries if p.grad is not None])
        if skipped:
            warnings.warn(f"distro-opt: {skipped}; this inner step is skipped")
        self.count += 1
        return self.count % self.sync_every == 0

    def _inner_step(self, opt, grads) -> str | None:
        """One inner step on unscaled finite gradients, with the outer groups' current settings;
        returns why it was skipped, or None."""
        if scaler_overflowed(opt):
            return "GradScaler found inf/NaN gradients"
        unscale = loss_unscale(opt)
        if unscale != 1.0 and grads:
            torch._foreach_mul_(grads, unscale)
        if not all_finite(grads):
            return "non-finite local gradient"
        for inner, outer in zip(self.inner_optimizer.param_groups, opt.param_groups):
            inner.update({k: outer[k] for k in INNER_KEYS if k in inner})
        self.inner_optimizer.step()
        return None

    def inputs(self, opt, entries) -> list[torch.Tensor]:
        """The pseudo-gradients ``anchor - p``, in the parameters' units (no loss scale); of the local
        shards for DTensor parameters."""
        anchors = [local(opt.state[p]["anchor"]) for _, p in entries]
        return [a - local(p).detach().to(a.dtype) for a, (_, p) in zip(anchors, entries)]

    def unscale(self, opt) -> float:
        return 1.0

    def contributes(self, opt) -> bool:
        return True

    def after_update(self, opt, entries) -> None:
        """Every worker restarts from the anchor, frozen parameters too: one frozen mid-interval
        drops its local steps since then (the outer step set the trained ones already)."""
        trained = {id(p) for _, p in entries}
        for group in opt.param_groups:
            for p in group["params"]:
                anchor = opt.state.get(p, {}).get("anchor")
                if anchor is not None and id(p) not in trained:
                    local(p).copy_(local(anchor))

    def add_param_group(self, group) -> None:
        self.inner_optimizer.add_param_group(inner_group(group))

    # -- checkpoints: everything in the groups and the per-parameter states, as torch.distributed.
    # checkpoint keeps them (it drops other top-level entries and needs parameter keys in "state")
    def save(self, opt, sd: dict) -> None:
        """Write the local-step count into every saved group, and each parameter's inner-optimizer
        state into its saved state under ``INNER_PREFIX`` (per worker: ``shards.per_replica``)."""
        for group in sd["param_groups"]:
            group["local_step"] = self.count
        params = [p for g in self.inner_optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            inner = self.inner_optimizer.state.get(p)
            if inner:
                own = dict(sd["state"].get(i, {}))
                own.update({INNER_PREFIX + k: per_replica(v, p) for k, v in inner.items()})
                sd["state"][i] = own

    def take_from(self, sd: dict):
        """Take this mode's entries out of ``sd`` (a copy, changed in place) before the outer state
        is checked and loaded; refuse what cannot be resumed, before anything changes."""
        if not is_local_step_checkpoint(sd):
            raise ValueError(MODE_MISMATCH)
        if "inner" in sd:  # the inner optimizer's whole state dict, the count in "state"
            inner = sd.pop("inner")
            saved = [len(g["params"]) for g in inner["param_groups"]]
            expected = [len(g["params"]) for g in self.inner_optimizer.param_groups]
            if saved != expected:
                raise ValueError(f"checkpoint's inner optimizer has groups of {saved} parameters, expected {expected}")
            sd["state"] = dict(sd["state"])
            return sd["state"].pop("local_step", 0), inner
        counts = {g.get("local_step") for g in sd["param_groups"]}
        count = next(iter(counts)) if len(counts) == 1 else None
        if not (isinstance(count, int) and count >= 0):
            raise ValueError(f"checkpoint's param groups disagree on the local step: {sorted(map(str, counts))}")
        sd["param_groups"] = [{k: v for k, v in g.items() if k != "local_step"} for g in sd["param_groups"]]
        inner_states, outer_states = {}, {}
        for i, st in sd["state"].items():
            inner_states[i] = {k[len(INNER_PREFIX):]: v for k, v in st.items() if k.startswith(INNER_PREFIX)}
            outer_states[i] = {k: v for k, v in st.items() if not k.startswith(INNER_PREFIX)}
        sd["state"] = {i: st for i, st in outer_states.items() if st}
        groups = self.inner_optimizer.state_dict()["param_groups"]
        return count, {"state": {i: st for i, st in inner_states.items() if st}, "param_groups": groups}

    def finish_load(self, opt, taken) -> None:
        self.count, inner = taken
        params = [p for g in self.inner_optimizer.param_groups for p in g["params"]]
        inner = {**inner, "state": {
            i: {k: from_per_replica(v, params[i]) if isinstance(i, int) and i < len(params) else v
                for k, v in st.items()}
            for i, st in inner["state"].items()
        }}
        self.inner_optimizer.load_state_dict(inner)

@contextlib.contextmanager
def synced_parameters(param_groups, state):
    """Within the block every parameter that has an anchor holds it; on exit each gets its own
    value back, bit for bit (see ``DisTrOAdamW.synced_parameters``). Reading ``state`` (a
    defaultdict) adds no entry to it."""
    swapped = []
    params = [p for g in param_groups for p in g["params"]]  # frozen ones too: they drifted before
    with torch.no_grad():
        for p in params:
            anchor = state.get(p, {}).get("anchor")
            if anchor is not None:
                swapped.append((p, p.detach().clone()))
                p.copy_(anchor)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, own in swapped:
                p.copy_(own)
