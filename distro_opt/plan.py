"""The step plan: for every segment of a payload layout, what runs, chosen once.

A step's work is per *segment* (``wire.py``): the parameters that share a chunk shape, k and value
bits, whose momentum is one flat buffer (``momentum.py``). What runs on a segment depends only on
its chunk, the momentum's dtype and device and the parameters' shapes, so ``plan_step`` decides it
once per layout, and the step (``step.py``) reads the decisions instead of asking again:

* ``forward``: the forward transform's path (``DCTTransform.forward_path``): "native" (the C kernel),
  "onednn" or "gemm";
* ``runs``: the members cut into batches of neighbours with one shape and one param group (one
  batched forward transform each);
* ``reader``: how top-k reads the coefficients, which stay in each tensor's own layout (``dct.py``):
  "rows" where every chunk already is a contiguous row, "runs" where chunks are scattered over rows
  in runs of at least ``MIN_RUN`` along the last axis (``topk.topk_abs_in_runs``, with the table of
  each chunk's runs), "copy" for shorter runs (copied to chunk-major rows and back);
* ``peaks``: where the forward path takes each run's peak while the data is in cache (native and
  oneDNN, with the "runs" reader), the reused buffer it goes to;
* ``codec``: the value codec of the segment's ``compression_bits`` (``values.py``).

A plan is cached by the optimizer under everything it depends on (``plan_key``), the process-wide
switch of the native kernel (``native.disabled()``) included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import dct, native
from .topk import topk_abs_in_runs, topk_abs_indices
from .transform import DCTTransform
from .values import value_codec
from .wire import PayloadLayout, Segment

# The forward transform batches neighbouring same-shape tensors up to this many elements (off the
# CPU its workspace holds one batch: 64 MB in float32; on the CPU it works in smaller slabs).
RUN_NUMEL = 1 << 24
# Top-k works on runs along the last axis of a chunk when they are at least this long; shorter ones
# are copied to chunk-major rows first.
MIN_RUN = 16


@dataclass
class SegmentPlan:
    """What runs on segment ``index`` of a layout (see the module)."""

    index: int
    seg: Segment
    shapes: list[tuple[int, ...]]  # each member's shape
    runs: list[tuple[list[int], tuple[int, int]]]  # (members, their (first, end) chunk rows)
    forward: str
    reader: str
    run_rows: torch.Tensor | None  # the "runs" reader's table
    peaks: torch.Tensor | None  # the run peaks' buffer, where the forward path fills it
    codec: object = field(repr=False)

    def select(self, stack: torch.Tensor):
        """Top-k per chunk of the segment's new momentum ``stack`` (the peaks buffer, when planned,
        already filled by the forward transform). Returns (indices within each chunk, chunk-major,
        as they travel; the kept values; a function that subtracts what was sent from ``stack``)."""
        seg = self.seg
        k, n = seg.k, seg.chunk_numel
        if self.reader == "rows":  # every chunk is already a contiguous row
            rows = stack.view(-1, n)
            idx = topk_abs_indices(rows, k)
            return idx, rows.gather(1, idx), lambda sent: rows.scatter_add_(1, idx, -sent)
        if self.reader == "runs":
            idx, pos = topk_abs_in_runs(stack.view(-1, seg.chunk[-1]), self.run_rows, k, self.peaks)
            return idx, stack.take(pos), lambda sent: stack.index_add_(0, pos.view(-1), sent.view(-1), alpha=-1)
        pieces = [(stack[a * n : b * n].view(s), a, b) for s, (a, b) in zip(self.shapes, seg.rows)]
        rows = torch.cat([dct.chunk_rows(x, seg.chunk) for x, _, _ in pieces])
        idx = topk_abs_indices(rows, k)

        def feedback(sent):
            rows.scatter_add_(1, idx, -sent)
            for x, a, b in pieces:
                x.view(dct.blocked_shape(x.shape, seg.chunk)).copy_(
                    dct.blocked(rows[a:b], tuple(x.shape) or (1,), seg.chunk)
                )

        return idx, rows.gather(1, idx), feedback


@dataclass
class StepPlan:
    """The layout and one ``SegmentPlan`` per segment."""

    layout: PayloadLayout
    segments: list[SegmentPlan]


def plan_key(layout: PayloadLayout, group_of: list[int], deltas) -> tuple:
    """What a plan depends on: the layout (by identity), each entry's param group (by position) and
    its momentum's dtype and device, and whether the native kernel may run."""
    return (id(layout), tuple(group_of), tuple((d.dtype, d.device) for d in deltas), native.active())


def plan_step(layout: PayloadLayout, group_of: list[int], deltas) -> StepPlan:
    """The plan of ``layout`` for entries in the param groups ``group_of`` (each entry's group
    position) whose momenta are ``deltas``."""
    return StepPlan(layout, [_plan_segment(layout, j, seg, group_of, deltas) for j, seg in enumerate(layout.segments)])


def _plan_segment(layout, j, seg, group_of, deltas) -> SegmentPlan:
    dtype = deltas[seg.members[0]].dtype
    for m in seg.members[1:]:
        dtype = torch.promote_types(dtype, deltas[m].dtype)
    device = deltas[seg.members[0]].device
    like = torch.empty(0, dtype=dtype, device=device)
    shapes = [layout.specs[m].shape for m in seg.members]
    forward = DCTTransform.forward_path(seg.chunk, like)
    if all(dct.own_layout_is_chunk_major(shape, seg.chunk) for shape in shapes):
        reader, run_rows = "rows", None
    elif seg.chunk[-1] < MIN_RUN:
        reader, run_rows = "copy", None
    else:
        reader, run_rows = "runs", _run_rows(seg, shapes, device)
    peaks = None
    if reader == "runs" and forward != "gemm":
        with torch.inference_mode(False):  # reused across steps
            peaks = torch.empty(seg.num_chunks * seg.chunk_numel // seg.chunk[-1], dtype=dtype)
    return SegmentPlan(j, seg, shapes, _runs(layout, seg, group_of), forward, reader, run_rows, peaks,
                       value_codec(seg.bits))


def _runs(layout, seg, group_of) -> list[tuple[list[int], tuple[int, int]]]:
    """The segment's members cut into runs of neighbours with one shape and one param group, at most
    RUN_NUMEL elements each, with the chunks (first, end) they occupy."""
    runs, numel = [], 0
    for m, (a, b) in zip(seg.members, seg.rows):
        size = math.prod(layout.specs[m].shape)
        prev = runs[-1][0][-1] if runs else None
        if (
            prev is not None
            and layout.specs[prev].shape == layout.specs[m].shape
            and group_of[prev] == group_of[m]
            and numel + size <= RUN_NUMEL
        ):
            runs[-1][0].append(m)
            runs[-1][1][1] = b
            numel += size
        else:
            runs.append(([m], [a, b]))
            numel = size
    return [(members, (a, b)) for members, (a, b) in runs]


def _run_rows(seg, shapes, device) -> torch.Tensor:
    """The members' ``dct.run_rows`` tables back to back: each chunk's runs, as rows of the stack."""
    tables, offset = [], 0
    with torch.inference_mode(False):
        for shape, (a, b) in zip(shapes, seg.rows):
            tables.append(dct.run_rows(shape, seg.chunk) + offset)
            offset += (b - a) * seg.chunk_numel // seg.chunk[-1]
        return torch.cat(tables).to(device)
