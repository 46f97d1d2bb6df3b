"""The chunked DCT as matrix products (torch's GEMMs, and oneDNN's for the forward transform), with
the bases and workspaces they reuse.

Every chunk along one axis is multiplied by D (forward) or D^T (inverse) in the tensor's own layout:
the last axis as one large GEMM of (rows, c) by (c, c), another axis as a batched D @ (c, rest)
product. Only the forward transform, which feeds this worker's own momentum, may go to oneDNN: the
inverse, which every worker runs on the same payloads, stays with torch's GEMMs, so workers apply
bit-identical updates whichever GEMM their forward transform used.
"""
from __future__ import annotations

import math
import platform

import torch

from .dct import dct_matrix

# The forward transform and the sparse inverse work in slabs of about this many elements (1 MB of
# float32), so what one product writes is read back from cache by the next.
SLAB_NUMEL = 1 << 18

# oneDNN's float32 GEMM, as torch exposes it for CPU inference (x @ W^T into a new tensor), or None
# where this torch build has no oneDNN, and off x86-64, where it was never measured against torch.mm.
_ONEDNN_LINEAR = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")
    else None
)
# oneDNN's reorder of a linear layer's weight into its own blocked layout (an opaque tensor that only
# ``_ONEDNN_LINEAR`` reads), or None: see ``GemmDCT.onednn_basis``.
_ONEDNN_PACK = None if _ONEDNN_LINEAR is None else getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)

# Whether oneDNN computes in bf16 on this CPU (asked once: the answer does not change).
_ONEDNN_BF16 = _ONEDNN_LINEAR is not None and bool(
    getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()
)


def onednn_gemm_dtype() -> torch.dtype:
    """The dtype in which oneDNN multiplies float32 data for the forward transform: bfloat16 where
    the user allowed oneDNN to compute float32 matrix products in bf16 (torch's process-wide
    ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, torch >= 2.9) and this CPU can;
    float32 otherwise (torch's default). The library never sets that flag itself: it also reaches
    every float32 matmul of the process that oneDNN computes, the model's included."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    if _ONEDNN_BF16 and getattr(matmul, "fp32_precision", None) == "bf16":
        return torch.bfloat16
    return torch.float32


def onednn_computes(x: torch.Tensor) -> bool:
    """Whether oneDNN takes the forward transform's GEMMs of ``x``: float32 on the CPU, outside
    autograd (the op has no derivative)."""
    return (
        _ONEDNN_LINEAR is not None
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` by oneDNN, into a new tensor (``weight`` may be ``onednn_basis``'s)."""
    return _ONEDNN_LINEAR(x, weight, None, "none", [], "")


class GemmDCT:
    """The DCT's GEMMs, with the basis matrices cached per (size, dtype, device) and reused
    workspaces: one instance serves one optimizer."""

    def __init__(self):
        self._bases: dict[tuple, torch.Tensor] = {}
        self._scratch: dict[tuple, torch.Tensor] = {}

    def __getstate__(self):
        """Copies and pickles start with empty caches: they are rebuilt on use, and oneDNN's
        reordered basis has no storage to copy."""
        state = self.__dict__.copy()
        state["_bases"], state["_scratch"] = {}, {}
        return state

    def workspace(self, purpose: str, shape: tuple[int, ...], like: torch.Tensor, dtype=None) -> torch.Tensor:
        """A reused buffer per ``purpose`` (of ``like``'s dtype unless ``dtype`` is given) on the CPU,
        where a fresh model-sized tensor costs more in page faults than filling it; a new tensor
        elsewhere (CUDA's caching allocator already reuses memory)."""
        dtype = like.dtype if dtype is None else dtype
        if like.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=like.device)
        n = math.prod(shape)
        buf = self._scratch.get((purpose, dtype))
        if buf is None or buf.numel() < n:
            with torch.inference_mode(False):
                buf = self._scratch[(purpose, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)

    def _cached(self, key: tuple, make) -> torch.Tensor:
        tensor = self._bases.get(key)
        if tensor is None:
            with torch.inference_mode(False):
                tensor = self._bases[key] = make()
        return tensor

    def basis(self, n: int, like: torch.Tensor, transposed: bool = False, dtype=None) -> torch.Tensor:
        """D (in ``like``'s dtype unless ``dtype`` is given), or D^T as a contiguous copy (a GEMM
        with a contiguous right factor runs faster than with a transposed view)."""
        dtype = like.dtype if dtype is None else dtype
        if transposed:
            key = ("transposed", n, dtype, like.device)
            return self._cached(key, lambda: self.basis(n, like, dtype=dtype).T.contiguous())
        return self._cached(("basis", n, dtype, like.device), lambda: dct_matrix(n, dtype, like.device))

    def onednn_basis(self, n: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
        """D as the weight of ``onednn_linear`` (which computes rows @ D^T), reordered once into
        oneDNN's own layout where this torch can, so no call reorders it again (the same bits)."""
        dtype = like.dtype if dtype is None else dtype
        if _ONEDNN_PACK is None:
            return self.basis(n, like, dtype=dtype)
        return self._cached(("onednn", n, dtype), lambda: _ONEDNN_PACK(self.basis(n, like, dtype=dtype)))

    def batched_basis(self, c: int, b: int, rest: int, like: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """D (or D^T) for a batch of b products D @ (c, rest). Repeated in memory when that copy is no
        larger than the data (rest >= c): torch's batched GEMM runs slower when the batch is an
        expanded (stride-0) view, as ``matmul`` broadcasting makes it."""
        basis = self.basis(c, like)
        basis = basis.T if inverse else basis
        if rest < c:
            return basis.expand(b, c, c)
        key = ("batched", c, b, inverse, like.dtype, like.device)
        return self._cached(key, lambda: basis.expand(b, c, c).contiguous())

    def rows(self, n: int, like: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """Rows ``which`` (any shape) of D (n x n), shape ``(*which.shape, n)`` (``index_select``
        gathers whole rows faster than indexing with a tensor)."""
        return self.basis(n, like).index_select(0, which.reshape(-1)).view(*which.shape, n)

    def forward_rows(self, rows: torch.Tensor, c: int, out: torch.Tensor | None, onednn: bool) -> torch.Tensor:
        """``rows @ D^T``, the DCT of every row of length ``c``: into ``out``, or into a new tensor
        when ``onednn`` (``onednn_computes``); returns where it is. oneDNN's and torch's results
        agree to float32 rounding, not always bit for bit."""
        if onednn:
            return onednn_linear(rows, self.onednn_basis(c, rows))
        return torch.mm(rows, self.basis(c, rows, transposed=True), out=out)

    def _axis(self, y: torch.Tensor, shape: tuple[int, ...], axis: int, c: int, inverse: bool, out=None):
        rest = math.prod(shape[axis + 1 :])
        if rest == 1:
            out = None if out is None else out.view(-1, c)
            if not inverse:
                return self.forward_rows(y.reshape(-1, c), c, out, onednn_computes(y))
            return torch.mm(y.reshape(-1, c), self.basis(c, y), out=out)
        y = y.reshape(-1, c, rest)
        return torch.bmm(self.batched_basis(c, y.shape[0], rest, y, inverse), y)

    def apply(self, y: torch.Tensor, shape: tuple[int, ...], chunk: tuple[int, ...], inverse: bool, first_axis=0, out=None):
        """Transform every chunk along every axis from ``first_axis`` on, in the tensor's own layout,
        so no data moves between the per-axis products. ``out`` receives the last product when that
        is the last axis's GEMM (check the result's ``data_ptr`` to know)."""
        axes = [axis for axis in range(first_axis, len(chunk)) if chunk[axis] > 1]
        for axis in axes:
            y = self._axis(y, shape, axis, chunk[axis], inverse, out=out if axis == axes[-1] else None)
        return y.reshape(shape)
