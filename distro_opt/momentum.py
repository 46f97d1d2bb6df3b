"""Where the error-feedback momentum of a payload segment lives during a step.

Each segment's momentum is one flat buffer: its members back to back, each in its tensor's own
layout (``dct.py``), so the transform writes it in place (``DCTTransform.accumulate``), and the
state holds views of it shaped like the parameters. How top-k reads it there is the step plan's
(``plan.py``).
"""
from __future__ import annotations

import torch


class MomentumStacks:
    """Per segment ``j`` of a layout: two flat momentum buffers used in turn.

    The state holds views of one buffer (the momentum committed last step) while the step writes
    the other, so nothing in the state changes before the step commits, and no step allocates (and
    page-faults) a model-sized tensor."""

    def __init__(self):
        self._pairs: dict[int, list[torch.Tensor]] = {}
        self._in_use: set[int] = set()

    def reset(self) -> None:
        """Forget the buffers (after loading a state: its tensors may be views of them)."""
        self._pairs = {}

    def begin_step(self, deltas) -> None:
        """Note the storage of every momentum in ``deltas`` (all of the optimizer's, the frozen
        parameters' included): after the layout changes (a parameter frozen or unfrozen), segment
        ``j``'s buffers may back other parameters' momentum, and must not be written."""
        self._in_use = {d.untyped_storage().data_ptr() for d in deltas}

    def open(self, j, seg, deltas):
        """Segment ``j``'s buffers for this step: (the committed momentum as one flat tensor, the
        buffer the new momentum goes to)."""
        new = self.spare(j, seg, deltas, self._in_use)
        return self.committed(j, seg, deltas, new), new

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
