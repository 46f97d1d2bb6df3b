"""What feeds the momentum, before it is compressed: the gradient itself, or the gradient divided by
its own root mean square (``precondition`` of ``DisTrOAdamW``).

``precondition="adam"`` gives each worker AdamW's second moment of its own gradients,
``v = b2 v + (1 - b2) g^2``, and feeds ``g / (sqrt(v / (1 - b2^t)) + eps)`` into the error feedback
instead of g (b2 = ``betas[1]``; t counts this worker's preconditioned steps). What the workers then
compress and exchange is an Adam-normalized momentum, as 1-bit Adam (Tang et al. 2021) compresses
one; with ``update="linear"`` the aggregate is applied as it is, with no sign. v never travels: each
worker keeps its own, and it is saved with the optimizer's state.

The new moments are computed here and stored only when the step's momentum is committed
(``commit``), so a step whose gather is refused changes nothing.
"""
from __future__ import annotations

import torch

from . import shards

PRECONDITIONS = ("none", "adam")
MOMENT, COUNT = "input_exp_avg_sq", "input_step"


def check_precondition(value, sync_every: int) -> None:
    """A known preconditioner, and none in the local-step mode (its inner optimizer takes the gradients)."""
    if value not in PRECONDITIONS:
        raise ValueError(f"Invalid precondition: {value!r} (expected one of {PRECONDITIONS})")
    if sync_every > 1 and value != "none":
        raise ValueError(
            f"precondition={value!r} applies to the per-step mode only (sync_every=1): in the "
            "local-step mode the inner optimizer takes the gradients"
        )


# The chunk size of each rule's default density (top-4 of each chunk): the preconditioned update
# keeps more of the data-parallel gain the denser it is sent (docs/results-workers.md), the sign
# step and the local-step mode keep DeMo's 64x64
DEFAULT_CHUNK = {"adam": 16, "none": 64}


def default_rule(precondition, update, chunk, sync_every: int) -> tuple:
    """``(precondition, update, chunk)`` with the defaults filled in where a value is None. In the
    per-step mode with neither rule given: ``precondition="adam"``, ``update="linear"``, 16x16
    chunks. A given update other than ``"linear"`` defaults to no preconditioner
    (``update="sign"`` alone is DeMo's rule, with its 64x64 chunks), and ``precondition="none"``
    alone to the sign update. The local-step mode: no preconditioner (its inner optimizer takes the
    gradients; the outer step replaces the update), 64x64 chunks."""
    if precondition is None:
        precondition = "adam" if sync_every == 1 and update in (None, "linear") else "none"
    if update is None:
        update = "linear" if precondition == "adam" else "sign"
    if chunk is None:
        chunk = DEFAULT_CHUNK.get(precondition, 64)
    return precondition, update, chunk


def precondition(entries, inputs, states):
    """``inputs`` (each entry's momentum input, None for zeros) preconditioned where the entry's group
    says ``"adam"``, with the moments to commit: [(index, new v, new count)]. ``states`` are the
    entries' state dicts as the step reads them (local tensors of a sharded parameter)."""
    out, pending = list(inputs), []
    for i, ((group, _), x, state) in enumerate(zip(entries, inputs, states)):
        if group.get("precondition", "none") != "adam" or x is None:
            continue
        beta2, eps = group["betas"][1], group["eps"]
        g = x if x.dtype in (torch.float32, torch.float64) else x.float()
        old = state.get(MOMENT)
        v = g * g * (1 - beta2) if old is None else torch.addcmul(old * beta2, g, g, value=1 - beta2)
        t = float(state.get(COUNT, 0.0)) + 1
        denom = (v / (1 - beta2**t)).sqrt_().add_(eps)
        out[i] = g / denom
        pending.append((i, v, t))
    return out, pending


def commit(entries, pending, opt_state) -> None:
    """Store the moments ``precondition`` computed, laid out like each parameter."""
    for i, v, t in pending:
        p = entries[i][1]
        with torch.inference_mode(False):  # the state outlives the step: ordinary tensors
            state = opt_state[p]
            state[MOMENT] = shards.like_param(v.clone(), p)
            state[COUNT] = torch.tensor(t)
