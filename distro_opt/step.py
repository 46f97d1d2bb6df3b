"""One optimizer step as a pipeline, top to bottom (DeMo, Peng, Quesnelle, Kingma 2024, arXiv 2411.19870,
Algorithm 1). Per parameter p with momentum input g (its gradient, or a pseudo-gradient):

    1. momentum + transform   Delta' = beta * Delta + s * DCT(g)            ``compress``
    2. select                 the top-k coefficients of every chunk         ``compress``
    3. quantize               the kept values in ``compression_bits``        ``compress``
    4. error feedback         Delta' -= what the receivers will dequantize   ``compress``
                              (or the kept values before quantization)
    5. pack                   every parameter into one uint8 buffer          ``PayloadLayout.pack``
    6. gather                 one all-gather of that buffer                  the optimizer's backend
    7. validate and unpack    every payload, before anything changes         ``unpack_payloads``
    8. aggregate              each coefficient: mean over the workers that kept it   ``aggregate``
                              (untrusted contributors: a trimmed mean over all)      ``aggregator``
    9. inverse transform      U = IDCT(aggregate)                            ``apply_update``
   10. update                 p <- rule(p, U): sign, rms, adam, outer        ``apply_update``, ``updates.py``

(beta = compression_decay; s = lr for DeMo, 1 for DisTrOAdamW.) The optimizer commits Delta' only
once every payload of the step has been validated, so a rejected step changes nothing. What runs on
each segment in stages 1-3 (forward path, batches, top-k reader, codec) is read from the step plan
(``plan.py``), decided once per layout; stage 8's rule is passed in (``aggregator``).

Because the DCT is orthonormal, keeping Delta in the DCT domain is the reference's spatial-domain
buffer in other coordinates, and saves one inverse transform per step. ``reference.py`` is the same
step written plainly, one parameter at a time; the tests hold this one to it. The speed comes from
three ideas kept out of this file: parameters sharing a chunk shape and settings are one *segment*
of the payload (``wire.py``) whose momentum is one flat buffer (``momentum.py``); the coefficients
stay in each tensor's own layout, where the transform writes them (``transform.py``); and top-k
reads them there as runs along the last axis.
"""
from __future__ import annotations

import functools
import warnings

import torch

from .robust import trimmed_mean_aggregate
from .values import PayloadError
from .wire import PayloadLayout, Segment


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the call where ``t`` already has it (a step makes several per parameter)."""
    return t if t.dtype == dtype else t.to(dtype)


def work_dtype(p: torch.Tensor) -> torch.dtype:
    """Where a parameter's momentum lives: float64 for float64 parameters, float32 for all others (in
    bf16, ``compression_decay=0.999`` would round to 1)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def momentum_state(state: dict, p: torch.Tensor) -> dict:
    """``state`` (the optimizer's ``state[p]``) with its step count and momentum, created at zero."""
    if "delta" not in state:
        with torch.inference_mode(False):  # an ordinary tensor: the state outlives the step
            state["step"] = torch.tensor(0.0)
            state["delta"] = torch.zeros(p.shape, dtype=work_dtype(p), device=p.device)
    return state


def all_finite(tensors) -> bool:
    """Whether every element of ``tensors`` is finite, read once at the end (on a GPU a read waits
    for the device). Tested element by element: a float16 norm is inf beyond 65504."""
    if not tensors:
        return True
    flags = [torch.isfinite(t).all() for t in tensors]
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())


def check_inputs(entries, inputs) -> None:
    """Refuse, naming it, what the step cannot compute on (before any state changes): parameters on
    the meta device, and sparse or otherwise non-strided momentum inputs."""
    for (_, p), x in zip(entries, inputs):
        if p.device.type == "meta":
            raise ValueError(
                f"cannot step a parameter of shape {tuple(p.shape)} on the meta device: materialize the "
                "model first (e.g. model.to_empty(device=...) and its initialization)"
            )
        if x is not None and x.layout != torch.strided:
            raise ValueError(
                f"the gradient of a parameter of shape {tuple(p.shape)} is {x.layout}: distro-opt takes "
                "dense gradients (torch.optim.SparseAdam takes sparse ones)"
            )


def compress(plan, entries, inputs, states, stacks, transform, scales, feedback="sent"):
    """Stages 1-4 for every segment of the step ``plan`` (``plan.py``), without touching the state.

    ``entries``: (group, parameter) pairs; ``inputs``: each one's momentum input (None: zeros);
    ``states``: each one's state dict (``momentum_state``); ``stacks``: the ``MomentumStacks``;
    ``transform``: the ``DCTTransform``; ``scales``: each group's input scale s, by ``id(group)``;
    ``feedback``: what stage 4 subtracts (``FEEDBACKS`` in ``settings.py``: "sent", the values as the
    receivers dequantize them, or "kept", the top-k values before quantization). Returns (parts, new
    momenta): per segment (indices, value bytes) to pack, and per parameter its new momentum (views
    of the stack buffer), or (None, None) when this worker must contribute nothing this step.

    A NaN or inf input spreads to every coefficient of its chunk, and top-k ranks those first, so
    checking what is about to be sent finds it without another pass over the inputs. It is checked
    as the receivers will dequantize it: a finite value beyond bf16's (or float32's) range travels as
    inf, which every receiver would refuse."""
    parts, news, sents = [], [None] * len(entries), []
    for sp in plan.segments:
        seg, n = sp.seg, sp.seg.chunk_numel
        deltas = [states[m]["delta"] for m in seg.members]
        old, new = stacks.open(sp.index, seg, deltas)
        for run, (a, b) in sp.runs:  # 1. new = beta * old + s * DCT(g), each run's peaks on the way
            group, last = entries[run[0]][0], seg.chunk[-1]
            xs = [_input(entries[m][1], inputs[m], new.dtype) for m in run]
            transform.accumulate(
                xs, seg.chunk, old[a * n : b * n], new[a * n : b * n],
                decay=group["compression_decay"], scale=scales[id(group)],
                peaks=None if sp.peaks is None else sp.peaks[a * n // last : b * n // last], path=sp.forward,
            )
        idx, kept, subtract = sp.select(new)  # 2. top-k per chunk
        vbytes, sent = sp.codec.quantize(kept)  # 3. sent: the values as unpacked
        subtract(kept if feedback == "kept" else sent)  # 4. error feedback: the momentum keeps the rest
        sents.append(sent)
        parts.append((idx, vbytes))
        with torch.inference_mode(False):  # the new state: views of the stack, copies where dtypes mix
            for m, d, (start, end) in zip(seg.members, deltas, seg.rows):
                news[m] = as_dtype(new[start * n : end * n].view(d.shape), d.dtype)
    if not all_finite(sents):
        warnings.warn(
            "distro-opt: non-finite local gradient (or momentum beyond the range of compression_bits' "
            "values); this worker contributes nothing this step"
        )
        return None, None
    return parts, news


def _input(p, x, dtype) -> torch.Tensor:
    if x is None:  # a parameter without a gradient this step feeds zeros: its momentum still decays
        return torch.zeros(p.shape, dtype=dtype, device=p.device)
    return as_dtype(x, dtype)


def unpack_payloads(entries, layout: PayloadLayout, bufs, comm) -> list:
    """Stage 7: every gathered payload validated and unpacked into (indices, values) per segment, the
    values in the dtype they are applied in. Non-contributing payloads are left out. An invalid
    payload raises ``PayloadError``, unless the backend drops invalid payloads (a volunteer run), in
    which case it is reported to the backend and left out."""
    unpacked = []
    for i, buf in enumerate(bufs):
        try:
            payload = layout.unpack(buf)
            if payload is not None:
                payload = _in_work_dtypes(entries, layout, payload)
        except PayloadError as exc:
            if not comm.drops_invalid_payloads:
                raise PayloadError(f"payload of worker {i} rejected: {exc}") from None
            warnings.warn(f"distro-opt: dropped invalid payload {i}: {exc}")
            comm.report_invalid(i)
            continue
        if payload is not None:
            unpacked.append(payload)
    return unpacked


def _in_work_dtypes(entries, layout, payload):
    """Each segment's values in its first member's momentum dtype, refused where that dtype cannot
    hold them: finite float64 values (``compression_bits=64``) beyond float32's range would be inf."""
    out = []
    for j, (seg, (idx, values)) in enumerate(zip(layout.segments, payload)):
        dtype = work_dtype(entries[seg.members[0]][1])
        narrower = torch.finfo(dtype).max < torch.finfo(values.dtype).max
        values = as_dtype(values, dtype)
        if narrower and not torch.isfinite(values).all():
            raise PayloadError(f"payload values beyond the range of {dtype} in segment {j}")
        out.append((idx, values))
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor goes to a GPU from pinned memory without waiting (a copy
    from ordinary memory would hold the host until the GPU's queued work is done)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def aggregate(seg: Segment, contributions, like: torch.Tensor):
    """Stage 8, DeMo's aggregate: each coefficient is the mean of the values of the workers that kept
    it (0 where nobody did). ``contributions``: one (indices, values) per worker, for one segment.

    Returned sparse, as (indices, weights) per chunk with repeats: a coefficient kept by n workers
    appears n times with weight value / n, so the repeats add up to the mean."""
    dev, dtype = like.device, like.dtype
    idx = to_device(torch.cat([i for i, _ in contributions], dim=1), dev)
    values = to_device(torch.cat([v.to(dtype) for _, v in contributions], dim=1), dev)
    m = idx.shape[1]
    if m * m <= seg.chunk_numel:  # few values per chunk: count repeats pairwise, no dense pass
        count = (idx.unsqueeze(2) == idx.unsqueeze(1)).sum(2).to(dtype)
    else:
        dense = torch.zeros(seg.num_chunks, seg.chunk_numel, dtype=dtype, device=dev)
        count = dense.scatter_add_(1, idx, torch.ones_like(values)).gather(1, idx)
    return idx, values / count


def aggregator(untrusted_fraction: float):
    """Stage 8's rule for a backend's ``untrusted_fraction``: DeMo's ``aggregate`` where every
    contributor is trusted (0), else the trimmed mean of ``robust.py``, which bounds what that share
    of rogues can do. Called as ``rule(seg, contributions, like)``."""
    if untrusted_fraction > 0:
        return functools.partial(trimmed_mean_aggregate, untrusted_fraction=untrusted_fraction, to_device=to_device)
    return aggregate


def apply_update(entries, layout: PayloadLayout, unpacked, states, transform, rule_of, aggregate_fn=aggregate) -> None:
    """Stages 8-10: per segment, the aggregate of the unpacked payloads (``aggregate_fn``, see
    ``aggregator``), its inverse transform U per parameter, and ``rule_of(group).apply(group, params,
    Us, states)`` (``updates.py``) on each group's parameters in the segment. With no payload at all U
    is zero (the rule still runs: the local-step mode's outer step moves on its momentum).

    U comes in the transform's blocked layout (``DCTTransform.inverse_sparse_groups``), which a
    contiguous parameter's view lines up with element for element, in lists that share a workspace
    (one per slab of the CPU's inverse GEMM): each list is applied before the next is computed."""
    for j, seg in enumerate(layout.segments):
        params = [entries[m][1] for m in seg.members]
        seg_states = [states[m] for m in seg.members]
        if unpacked:
            contributions, like = [d[j] for d in unpacked], seg_states[0]["delta"]
            idx, weights = aggregate_fn(seg, contributions, like)
            pieces = [(a, b, tuple(p.shape)) for p, (a, b) in zip(params, seg.rows)]
            # lists of directions usable together (a list's workspace may be reused for the next)
            direction_lists = transform.inverse_sparse_groups(idx, weights, seg.chunk, pieces)
        else:
            direction_lists = [[
                torch.zeros(transform.blocked_shape(p.shape, seg.chunk), dtype=st["delta"].dtype, device=p.device)
                for p, st in zip(params, seg_states)
            ]]
        # applied updates counted alike on every worker (one 0-d tensor added to all: faster than
        # the number 1.0, which torch wraps once per tensor)
        steps = [st["step"] for st in seg_states]
        torch._foreach_add_(steps, [torch.ones((), dtype=steps[0].dtype)] * len(steps))
        done = 0
        for directions in direction_lists:
            members = range(done, done + len(directions))
            done += len(directions)
            by_group: dict[int, tuple[dict, list]] = {}  # each group's rule updates its tensors together
            for i, direction in zip(members, directions):
                p = params[i]
                if not p.is_contiguous():  # no blocked view of p: bring the direction to p's layout
                    direction = direction.reshape(p.shape)
                group = entries[seg.members[i]][0]
                by_group.setdefault(id(group), (group, []))[1].append((p, direction, seg_states[i]))
            for group, items in by_group.values():
                ps, us, sts = (list(column) for column in zip(*items))
                rule_of(group).apply(group, ps, us, sts)
