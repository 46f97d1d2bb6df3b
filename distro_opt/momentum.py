"""Where the error-feedback momentum of a payload segment lives during a step, and how top-k reads it.

Each segment's momentum is one flat buffer: its members back to back, each in its tensor's own
layout (``dct.py``), so the transform writes it in place (``DCTTransform.accumulate``), and the
state holds views of it shaped like the parameters. A chunk's coefficients are then not contiguous:
top-k finds them as runs along the last axis (``topk.topk_abs_in_runs``), ranked by each run's peak,
which the native and oneDNN paths take while the data is in cache.
"""
from __future__ import annotations

import math

import torch

from . import dct
from .topk import topk_abs_in_runs, topk_abs_indices
from .transform import DCTTransform

# The forward transform batches neighbouring same-shape tensors up to this many elements (off the
# CPU its workspace holds one batch: 64 MB in float32; on the CPU it works in smaller slabs).
RUN_NUMEL = 1 << 24
# Top-k works on runs along the last axis of a chunk when they are at least this long; shorter ones
# are copied to chunk-major rows first.
MIN_RUN = 16


class MomentumStacks:
    """Per segment ``j`` of a layout: two flat momentum buffers used in turn, and the top-k over one.

    The state holds views of one buffer (the momentum committed last step) while the step writes
    the other, so nothing in the state changes before the step commits, and no step allocates (and
    page-faults) a model-sized tensor."""

    def __init__(self, transform: DCTTransform):
        self.transform = transform
        self._pairs: dict[int, list[torch.Tensor]] = {}
        self._run_tables: dict[tuple, torch.Tensor | None] = {}
        self._peaks: dict[int, torch.Tensor] = {}
        self._in_use: set[int] = set()

    def reset(self) -> None:
        """Forget the buffers (after loading a state: its tensors may be views of them)."""
        self._pairs = {}

    def begin_step(self, deltas) -> None:
        """Note the storage of every momentum in ``deltas`` (all of the optimizer's, the frozen
        parameters' included): after the layout changes (a parameter frozen or unfrozen), segment
        ``j``'s buffers may back other parameters' momentum, and must not be written."""
        self._in_use = {d.untyped_storage().data_ptr() for d in deltas}

    def open(self, layout, j, seg, deltas):
        """Segment ``j``'s buffers for this step: (the committed momentum as one flat tensor, the
        buffer the new momentum goes to, the run-peaks buffer or None; see ``peaks``)."""
        new = self.spare(j, seg, deltas, self._in_use)
        old = self.committed(j, seg, deltas, new)
        return old, new, self.peaks(layout, j, seg, new)

    @staticmethod
    def runs(entries, layout, seg) -> list[tuple[list[int], tuple[int, int]]]:
        """The segment's members cut into runs of neighbours with one shape and one param group, at most
        RUN_NUMEL elements each (one batched transform each), with the chunks (first, end) they occupy."""
        runs, numel = [], 0
        for m, (a, b) in zip(seg.members, seg.rows):
            size = math.prod(layout.specs[m].shape)
            prev = runs[-1][0][-1] if runs else None
            if (
                prev is not None
                and layout.specs[prev].shape == layout.specs[m].shape
                and entries[prev][0] is entries[m][0]
                and numel + size <= RUN_NUMEL
            ):
                runs[-1][0].append(m)
                runs[-1][1][1] = b
                numel += size
            else:
                runs.append(([m], [a, b]))
                numel = size
        return [(members, (a, b)) for members, (a, b) in runs]


    def spare(self, j, seg, deltas, in_use: set[int]) -> torch.Tensor:
        """The buffer that no state tensor views (``in_use``: their storage addresses): this step's
        new momentum goes there."""
        dtype = deltas[0].dtype
        for other in {d.dtype for d in deltas} - {dtype}:
            dtype = torch.promote_types(dtype, other)
        shape, device = (seg.num_chunks * seg.chunk_numel,), deltas[0].device
        pair = self._pairs.get(j)
        if (
            pair is None
            or (pair[0].shape, pair[0].dtype, pair[0].device) != (shape, dtype, device)
            or all(buf.untyped_storage().data_ptr() in in_use for buf in pair)
        ):  # fresh buffers: no state tensor can be a view of them
            with torch.inference_mode(False):
                pair = self._pairs[j] = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]
        return next(buf for buf in pair if buf.untyped_storage().data_ptr() not in in_use)

    def committed(self, j, seg, deltas, spare) -> torch.Tensor:
        """The committed momentum as one flat buffer: the other buffer of the pair when the state
        holds its views in order (every step but the first, or one after loading), else a copy."""
        other = next((buf for buf in self._pairs[j] if buf is not spare), None)
        n = seg.chunk_numel
        if other is not None and other.dtype == spare.dtype and all(
            d.dtype == other.dtype and d.data_ptr() == other.data_ptr() + a * n * other.element_size() and d.is_contiguous()
            for d, (a, _) in zip(deltas, seg.rows)
        ):
            return other
        return torch.cat([d.reshape(-1).to(spare.dtype) for d in deltas])

    def peaks(self, layout, j, seg, stack) -> torch.Tensor | None:
        """A reused buffer for the largest magnitude of each run of ``seg.chunk[-1]`` coefficients of
        segment ``j``'s ``stack`` (see ``DCTTransform.accumulate``), where the transform can fill it
        and top-k reads runs (``DCTTransform.fills_peaks``; runs of at least MIN_RUN, scattered over
        rows). None elsewhere."""
        if seg.chunk[-1] < MIN_RUN or not self.transform.fills_peaks(seg.chunk, stack):
            return None
        if self._run_rows(layout, j, seg, stack.device) is None:  # chunks are rows: no runs to rank
            return None
        numel = stack.numel() // seg.chunk[-1]
        buf = self._peaks.get(j)
        if buf is None or buf.numel() != numel or buf.dtype != stack.dtype:
            with torch.inference_mode(False):
                buf = self._peaks[j] = torch.empty(numel, dtype=stack.dtype)
        return buf

    def select(self, layout, j, seg, stack, peaks=None):
        """Top-k per chunk of the segment's new momentum ``stack``; ``peaks``, when given, already
        holds each run's largest magnitude (the transform filled the buffer of ``peaks()``).

        Returns (indices within each chunk, chunk-major, as they travel; the kept values; a function
        that subtracts what was sent from ``stack``)."""
        k, n = seg.k, seg.chunk_numel
        run_rows = self._run_rows(layout, j, seg, stack.device)
        if run_rows is None:
            rows = stack.view(-1, n)  # every chunk is already a contiguous row
            idx = topk_abs_indices(rows, k)
            return idx, rows.gather(1, idx), lambda sent: rows.scatter_add_(1, idx, -sent)
        if seg.chunk[-1] >= MIN_RUN:  # chunks scattered over rows: top-k over runs along the last axis
            idx, pos = topk_abs_in_runs(stack.view(-1, seg.chunk[-1]), run_rows, k, peaks)
            return idx, stack.take(pos), lambda sent: stack.index_add_(0, pos.view(-1), sent.view(-1), alpha=-1)
        # short runs: copy to chunk-major rows and back
        shapes = [layout.specs[m].shape for m in seg.members]
        pieces = [(stack[a * n : b * n].view(s), a, b) for s, (a, b) in zip(shapes, seg.rows)]
        rows = torch.cat([dct.chunk_rows(x, seg.chunk) for x, _, _ in pieces])
        idx = topk_abs_indices(rows, k)

        def feedback(sent):
            rows.scatter_add_(1, idx, -sent)
            for x, a, b in pieces:
                x.view(dct.blocked_shape(x.shape, seg.chunk)).copy_(
                    dct.blocked(rows[a:b], tuple(x.shape) or (1,), seg.chunk)
                )

        return idx, rows.gather(1, idx), feedback

    def _run_rows(self, layout, j, seg, device) -> torch.Tensor | None:
        """Segment ``j``'s ``DCTTransform.run_rows`` tables back to back (cached), None when every
        member's own layout already lists its chunks as rows, empty for the copy path."""
        key = (id(layout), j, device)
        if key not in self._run_tables:
            with torch.inference_mode(False):
                self._run_tables[key] = self._new_run_rows(layout, seg, device)
        return self._run_tables[key]

    def _new_run_rows(self, layout, seg, device) -> torch.Tensor | None:
        shapes = [layout.specs[m].shape for m in seg.members]
        if all(dct.own_layout_is_chunk_major(shape, seg.chunk) for shape in shapes):
            return None
        if seg.chunk[-1] < MIN_RUN:
            return torch.empty(0)
        tables, offset = [], 0
        for m, (a, b) in zip(seg.members, seg.rows):
            tables.append(dct.run_rows(layout.specs[m].shape, seg.chunk) + offset)
            offset += (b - a) * seg.chunk_numel // seg.chunk[-1]
        return torch.cat(tables).to(device)
