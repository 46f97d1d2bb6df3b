"""``DCTTransform``: the one interface to the chunked DCT (``dct.py``) and its fast paths.

The forward transform's path is chosen in one place, ``DCTTransform.forward_path``, which the
step plan (``plan.py``) asks once per layout segment:

* ``"native"``: the C kernel (``native.py``) for float32 CPU matrices of 64 x 64 chunks, where it
  was built: the decayed sum and each run's peak in one pass per chunk;
* ``"onednn"``: oneDNN's GEMMs for other float32 CPU matrices (``forward_paths.accumulate_onednn``),
  the run peaks taken from cache;
* ``"gemm"``: torch's GEMMs in slabs for every other shape, dtype and device
  (``forward_paths.accumulate_slabs``).

All three give the orthonormal DCT-II to float32 rounding (not the same bits). The inverse always
runs on torch's GEMMs (``gemm.py``), so every worker applies bit-identical updates. ``reference.py``
holds the plain version of the same products, and the tests hold this one to it.
"""
from __future__ import annotations

import math

import torch

from . import dct, native
from . import gemm as gemm_module
from .forward_paths import accumulate_onednn, accumulate_slabs
from .gemm import GemmDCT, onednn_computes

FORWARD_PATHS = ("native", "onednn", "gemm")


class DCTTransform:
    """Chunked orthonormal DCT-II and its inverse, for tensors of any rank; one instance serves one
    optimizer (it caches the bases and reuses its workspaces)."""

    # the layouts, as module functions of ``dct`` (public here too: callers hold a transform)
    chunk_shape = staticmethod(dct.chunk_shape)
    blocked_shape = staticmethod(dct.blocked_shape)
    chunk_major = staticmethod(dct.chunk_major)
    chunk_rows = staticmethod(dct.chunk_rows)
    blocked = staticmethod(dct.blocked)
    run_rows = staticmethod(dct.run_rows)
    own_layout_is_chunk_major = staticmethod(dct.own_layout_is_chunk_major)
    first_and_last_only = staticmethod(dct.first_and_last_only)

    def __init__(self):
        self.gemm = GemmDCT()

    # -- forward --------------------------------------------------------------------------------
    @staticmethod
    def forward_path(chunk: tuple[int, ...], like: torch.Tensor) -> str:
        """Which path computes the forward transform into tensors like ``like`` (see the module)."""
        if native.handles(chunk, like):
            return "native"
        if onednn_computes(like) and dct.first_and_last_only(chunk):
            return "onednn"
        return "gemm"

    @classmethod
    def fills_peaks(cls, chunk: tuple[int, ...], like: torch.Tensor) -> bool:
        """Whether ``accumulate`` into tensors like ``like`` also takes each run's peak."""
        return cls.forward_path(chunk, like) != "gemm"

    def accumulate(self, xs, chunk, old, out, decay: float, scale: float, peaks=None, path=None) -> bool:
        """``out = decay * old + scale * DCT(x)`` for every ``x`` of ``xs`` (tensors of one shape),
        where ``old`` and ``out`` are flat and hold the xs' coefficients back to back, each in its
        tensor's own layout (``old`` None: zeros, on the native and oneDNN paths).

        ``peaks`` (optional, flat, one entry per run of ``chunk[-1]`` coefficients along the last
        axis of ``out``) receives each run's largest magnitude where the path takes it while the
        data is in cache (``fills_peaks``); returns whether it did. ``path``: the forward path where
        the caller chose it already (a step plan, ``plan.py``); else it is chosen here."""
        path = path or self.forward_path(chunk, out)
        if path == "native":
            native.accumulate(xs, old, out, decay, scale, peaks)
        elif path == "onednn":
            accumulate_onednn(self.gemm, xs, chunk, old, out, decay, scale, peaks)
        else:
            accumulate_slabs(self.gemm, xs, chunk, old, out, decay, scale)
            return False
        return peaks is not None

    def forward(self, x: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """DCT of every chunk of ``x``, left in ``x``'s own layout. May return ``x`` itself when no
        dimension is transformed."""
        if self.fills_peaks(chunk, x):  # the native or the oneDNN path: through the decayed sum
            out = torch.empty(x.shape, dtype=x.dtype)
            self.accumulate([x], chunk, None, out.view(-1), decay=0.0, scale=1.0)
            return out
        return self.gemm.apply(x, tuple(x.shape) or (1,), chunk, inverse=False)

    def coefficient_rows(self, x: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """DCT of every chunk of ``x``: a (num_chunks, chunk_numel) coefficient matrix."""
        return dct.chunk_rows(self.forward(x, chunk), chunk)

    # -- inverse --------------------------------------------------------------------------------
    def inverse(self, y: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """Inverse of ``forward``: coefficients in the tensor's own layout back to the tensor."""
        return self.gemm.apply(y, tuple(y.shape) or (1,), chunk, inverse=True).reshape(y.shape)

    def unchunk(self, y: torch.Tensor, full: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
        """Chunk rows back to the tensor's own layout (a copy)."""
        return dct.unchunk(y, full, chunk)

    def from_coefficient_rows(self, coeffs: torch.Tensor, shape: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
        """Inverse of ``coefficient_rows``: coefficients (num_chunks, chunk_numel) back to a tensor of ``shape``."""
        full = tuple(shape) or (1,)
        return self.gemm.apply(dct.unchunk(coeffs, full, chunk), full, chunk, inverse=True).reshape(shape)

    def inverse_sparse_pieces(self, idx: torch.Tensor, values: torch.Tensor, chunk, pieces):
        """Inverse DCT of stacked chunks given as (indices, values), both (num_chunks, m), repeated
        indices adding up; ``pieces`` = [(first row, end row, shape)] cuts the stack into tensors.

        Yields each tensor in turn in the blocked layout, shape ``blocked_shape(shape, chunk)``, as a
        view that is not necessarily contiguous: a contiguous tensor of ``shape`` viewed the same way
        lines up element for element, so an update needs no copy back to the tensor's own layout.
        A yielded view may share a workspace of this transform: use it before asking for the next
        (``inverse_sparse_groups`` says which views can be used together)."""
        for group in self.inverse_sparse_groups(idx, values, chunk, pieces):
            yield from group

    def inverse_sparse_groups(self, idx: torch.Tensor, values: torch.Tensor, chunk, pieces):
        """``inverse_sparse_pieces``, yielded as lists of consecutive pieces' views that stay valid
        together: use a list before asking for the next, which may overwrite its workspace.

        With few coefficients per chunk (m < the sum of the chunk's sides) each chunk is a product of
        its m first-axis basis rows and m last-axis basis rows (a batched GEMM with inner size m),
        cheaper than the dense inverse; otherwise the dense inverse. On the CPU that GEMM runs on
        consecutive pieces of about ``gemm.SLAB_NUMEL`` elements at a time (one list each), into one
        workspace, so the update reads each piece back from cache; elsewhere all pieces are one list."""
        if len(chunk) > 2 or idx.shape[1] >= sum(chunk):
            dense = torch.zeros(idx.shape[0], math.prod(chunk), dtype=values.dtype, device=values.device)
            dense.scatter_add_(1, idx, values)
            yield [self.from_coefficient_rows(dense[a:b], shape, chunk).view(dct.blocked_shape(shape, chunk))
                   for a, b, shape in pieces]
            return
        last = self.gemm.rows(chunk[-1], values, idx % chunk[-1]) * values.unsqueeze(-1)  # (B, m, c_last)
        if len(chunk) == 1:
            y = last.sum(1)
            yield [dct.blocked(y[a:b], tuple(shape) or (1,), chunk) for a, b, shape in pieces]
            return
        first = self.gemm.rows(chunk[0], values, idx // chunk[-1]).transpose(1, 2)  # (B, c_first, m)
        per = gemm_module.SLAB_NUMEL // math.prod(chunk) if values.device.type == "cpu" else idx.shape[0]
        for group in _slab_pieces(pieces, per):
            lo, hi = group[0][0], group[-1][1]
            y = self.gemm.workspace("inverse", (hi - lo, *chunk), values)
            torch.bmm(first[lo:hi], last[lo:hi], out=y)
            yield [dct.blocked(y[a - lo : b - lo], tuple(shape) or (1,), chunk) for a, b, shape in group]

    def inverse_sparse(self, idx: torch.Tensor, values: torch.Tensor, shape, chunk) -> torch.Tensor:
        """``from_coefficient_rows`` of one tensor's coefficients given as (indices, values) per chunk."""
        (blocked,) = self.inverse_sparse_pieces(idx, values, chunk, [(0, idx.shape[0], shape)])
        return blocked.clone(memory_format=torch.contiguous_format).view(shape)  # its own memory, not the workspace


def _slab_pieces(pieces, per: int):
    """Consecutive ``pieces`` in groups spanning at most ``per`` rows (a longer piece alone)."""
    group = []
    for piece in pieces:
        if group and piece[1] - group[0][0] > per:
            yield group
            group = []
        group.append(piece)
    if group:
        yield group
