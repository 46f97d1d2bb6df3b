"""Chunked orthonormal DCT-II, DeMo's transform (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870, Sec. 3).

A tensor of shape (n_1, ..., n_d) is cut into chunks of shape (c_1, ..., c_d), where c_i is the
largest divisor of n_i that is <= the target chunk (n_i itself when n_i <= target; a prime n_i >
target gives c_i = 1, no transform along that dim). Every chunk gets a separable d-dimensional DCT-II
with the orthonormal basis D_c[k, n] = sqrt(2/c) * a_k * cos(pi * (2n + 1) * k / (2c)), a_0 = 1/sqrt(2),
a_k = 1 otherwise (scipy.fft.dct(type=2, norm="ortho")). Being orthonormal, the inverse is D_c^T.

``forward`` and ``accumulate`` leave the coefficients in the tensor's own layout (element [i, j] of a
matrix is coefficient (i mod c_1, j mod c_2) of chunk (i // c_1, j // c_2)): no permutation pass, and
the top-k reads each chunk's coefficients as runs along the last axis (``select.topk_abs_in_runs``).
``encode`` gives chunk-major (num_chunks, chunk_numel) rows.
"""
from __future__ import annotations

import functools
import math
import platform

import torch

from . import native
from .kept import kept_tensors

# ``accumulate`` works in slabs of about this many elements (1 MB of float32), so the intermediate
# between the axes is read back from cache.
SLAB_NUMEL = 1 << 18

# oneDNN's float32 GEMM, as torch exposes it for CPU inference (x @ W^T into a new tensor), or None
# where this torch build has no oneDNN, and off x86-64, where it was never measured against torch.mm.
# See ``DCTTransform._forward_rows``.
_ONEDNN_LINEAR = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")
    else None
)
# oneDNN's reorder of a linear layer's weight into its own blocked layout (an opaque tensor that only
# ``_ONEDNN_LINEAR`` reads), or None: see ``DCTTransform._onednn_basis``.
_ONEDNN_PACK = None if _ONEDNN_LINEAR is None else getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)

# Whether oneDNN computes in bf16 on this CPU (asked once: the answer does not change).
_ONEDNN_BF16 = _ONEDNN_LINEAR is not None and bool(
    getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()
)


def onednn_gemm_dtype() -> torch.dtype:
    """The dtype in which ``_accumulate_onednn`` multiplies float32 data: bfloat16 where the user
    allowed oneDNN to compute float32 matrix products in bf16 (torch's process-wide
    ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, torch >= 2.9) and this CPU can;
    float32 otherwise (torch's default). The library never sets that flag itself: it also reaches
    every float32 matmul of the process that oneDNN computes, the model's included."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    if _ONEDNN_BF16 and getattr(matmul, "fp32_precision", None) == "bf16":
        return torch.bfloat16
    return torch.float32


def _onednn_computes(x: torch.Tensor) -> bool:
    """Whether ``_ONEDNN_LINEAR`` takes the forward transform's GEMMs of ``x``: float32 on the CPU,
    outside autograd (the op has no derivative)."""
    return (
        _ONEDNN_LINEAR is not None
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def chunk_size(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is <= ``target`` (``n`` itself when ``n <= target``)."""
    if n <= target:
        return n
    for c in range(target, 0, -1):
        if n % c == 0:
            return c
    return 1


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n x n): ``D @ x`` is ``scipy.fft.dct(x, norm="ortho")``."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(dtype=dtype, device=device)


class DCTTransform:
    """Chunked orthonormal DCT-II and its inverse, for tensors of any rank.

    The DCT matrices are cached per (size, dtype, device) in the instance: one transform object
    serves one optimizer.
    """

    def __init__(self):
        self._bases: dict[tuple, torch.Tensor] = {}
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    @staticmethod
    def chunk_shape(shape: tuple[int, ...], target: int) -> tuple[int, ...]:
        """Chunk shape of a tensor of ``shape``; a 0-d tensor is treated as shape (1,)."""
        return tuple(chunk_size(n, target) for n in (tuple(shape) or (1,)))

    def _workspace(self, purpose: str, shape: tuple[int, ...], like: torch.Tensor, dtype=None):
        """A reused buffer per ``purpose`` (of ``like``'s dtype unless ``dtype`` is given) on the CPU,
        where a fresh model-sized tensor costs more in page faults (~2.5 ms per 20 MB here) than
        filling it; a new tensor elsewhere (CUDA's caching allocator already reuses memory)."""
        dtype = like.dtype if dtype is None else dtype
        if like.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=like.device)
        n = math.prod(shape)
        buf = self._scratch.get((purpose, dtype))
        if buf is None or buf.numel() < n:
            with kept_tensors():
                buf = self._scratch[(purpose, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)

    def _basis(self, n: int, like: torch.Tensor, transposed: bool = False, dtype=None) -> torch.Tensor:
        """D (in ``like``'s dtype unless ``dtype`` is given), or D^T as a contiguous copy (a GEMM
        with a contiguous right factor ran ~7% faster here than with a transposed view)."""
        dtype = like.dtype if dtype is None else dtype
        if transposed:
            key = ("transposed", n, dtype, like.device)
            return self._cached(key, lambda: self._basis(n, like, dtype=dtype).T.contiguous())
        key = ("basis", n, dtype, like.device)
        return self._cached(key, lambda: dct_matrix(n, dtype, like.device))

    def _cached(self, key: tuple, make) -> torch.Tensor:
        """The basis tensor cached under ``key`` (its first entry names the kind), ``make()`` once."""
        tensor = self._bases.get(key)
        if tensor is None:
            with kept_tensors():
                tensor = self._bases[key] = make()
        return tensor

    def _onednn_basis(self, n: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
        """D as the weight of ``_ONEDNN_LINEAR`` (which computes rows @ D^T), reordered once into
        oneDNN's own layout where this torch can (``_ONEDNN_PACK``), so no call reorders it again:
        the step ~1% faster (A/B, 1 and 2 threads), the same bits. The reordered tensor has no
        storage torch can copy: ``__getstate__`` leaves the caches out."""
        dtype = like.dtype if dtype is None else dtype
        if _ONEDNN_PACK is None:
            return self._basis(n, like, dtype=dtype)
        return self._cached(("onednn", n, dtype), lambda: _ONEDNN_PACK(self._basis(n, like, dtype=dtype)))

    def __getstate__(self):
        """Copies and pickles of a transform start with empty caches: they are rebuilt on use, and
        oneDNN's reordered basis has no storage to copy."""
        state = self.__dict__.copy()
        state["_bases"], state["_scratch"] = {}, {}
        return state

    def _batched_basis(self, c: int, b: int, rest: int, like: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """D (or D^T) for a batch of b products D @ (c, rest). Repeated in memory when that copy is no
        larger than the data (rest >= c): torch's batched GEMM runs ~1.8x slower (measured) when the
        batch is an expanded (stride-0) view, as ``matmul`` broadcasting makes it."""
        basis = self._basis(c, like)
        basis = basis.T if inverse else basis
        if rest < c:
            return basis.expand(b, c, c)
        key = ("batched", c, b, inverse, like.dtype, like.device)
        return self._cached(key, lambda: basis.expand(b, c, c).contiguous())

    def _axis(self, y: torch.Tensor, shape: tuple[int, ...], axis: int, c: int, inverse: bool, out=None):
        """Multiply every chunk along ``axis`` by D (forward) or D^T (inverse), in the tensor's own
        layout: the last axis as one large GEMM, another as a batched D @ (c, rest) product."""
        rest = math.prod(shape[axis + 1 :])
        if rest == 1:
            out = None if out is None else out.view(-1, c)
            if not inverse:
                return self._forward_rows(y.reshape(-1, c), c, out, _onednn_computes(y))
            return torch.mm(y.reshape(-1, c), self._basis(c, y), out=out)
        y = y.reshape(-1, c, rest)
        return torch.bmm(self._batched_basis(c, y.shape[0], rest, y, inverse), y)

    def _forward_rows(self, rows: torch.Tensor, c: int, out: torch.Tensor | None, onednn: bool):
        """``rows @ D^T``, the DCT of every row of length ``c``: into ``out``, or into a new tensor
        when ``onednn`` (``_onednn_computes``) and oneDNN's GEMM computes it; returns where it is.

        Only the forward transform, which feeds this worker's own momentum, goes to oneDNN: the
        inverse, which every worker runs on the same payloads, stays with torch.mm, so workers apply
        bit-identical updates whichever GEMM their forward transform used. On this AMD CPU torch.mm
        (MKL's sgemm) took 2-2.4x as long for these (rows, 64) by (64, 64) products (standalone,
        1 and 2 threads); results agree to float32 rounding, not always bit for bit."""
        if onednn:
            return _ONEDNN_LINEAR(rows, self._onednn_basis(c, rows), None, "none", [], "")
        return torch.mm(rows, self._basis(c, rows, transposed=True), out=out)

    def _apply(self, y: torch.Tensor, shape: tuple[int, ...], chunk: tuple[int, ...], inverse: bool, first_axis=0, out=None):
        """Transform every chunk along every axis from ``first_axis`` on, in the tensor's own layout,
        so no data moves between the per-axis products. ``out`` receives the last product when that
        is the last axis's GEMM (check the result's ``data_ptr`` to know)."""
        axes = [axis for axis in range(first_axis, len(chunk)) if chunk[axis] > 1]
        for axis in axes:
            y = self._axis(y, shape, axis, chunk[axis], inverse, out=out if axis == axes[-1] else None)
        return y.reshape(shape)

    def accumulate(
        self, xs: list[torch.Tensor], chunk, old: torch.Tensor, out: torch.Tensor, decay: float, scale: float,
        peaks: torch.Tensor | None = None,
    ) -> bool:
        """``out = decay * old + scale * DCT(x)`` for every ``x`` of ``xs`` (tensors of one shape),
        where ``old`` and ``out`` are flat and hold the xs' coefficients back to back, each in its
        tensor's own layout (as ``forward`` returns them).

        ``peaks`` (optional, flat, one entry per run of ``chunk[-1]`` coefficients along the last
        axis of ``out``) receives each run's largest magnitude where the path can take it while the
        slab is in cache (the native kernel and the oneDNN path); returns whether it did.

        float32 CPU matrices of 64 x 64 chunks go to the C kernel where it was built (``native``).

        On the CPU the xs are taken in slabs of whole first-axis blocks, about ``SLAB_NUMEL``
        elements each (several small tensors share one; elsewhere the whole run is one slab), so the
        intermediate between the axes is read back while it is still in cache (the transform alone:
        7% faster at 1 thread, 2-3% at 2). Matrices in float32 on the CPU go to oneDNN
        (``_accumulate_onednn``). Otherwise all axes but the first are transformed into a workspace,
        then the first axis and the accumulation are one batched GEMM over the slab (``baddbmm``
        with beta = decay)."""
        shape = tuple(xs[0].shape) or (1,)
        n, total = math.prod(shape), len(xs) * math.prod(shape)
        c, rest = chunk[0], n // shape[0]
        inner = [axis for axis in range(1, len(chunk)) if chunk[axis] > 1]  # transformed before the first
        last_only = inner == [len(chunk) - 1]
        onednn = _onednn_computes(out)
        if self._native(chunk, out):
            native.accumulate(xs, old, out, decay, scale, peaks)
            return peaks is not None
        if onednn and self.first_and_last_only(chunk):  # old may be None here (``forward``), out never
            self._accumulate_onednn(xs, chunk, old, out, decay, scale, peaks)
            return peaks is not None
        if last_only:  # the last axis alone (a matrix's case): one GEMM per part, on rows of that axis
            last = chunk[-1]
            rows = [x.reshape(-1, last) for x in xs]
        else:
            flats = [x.reshape(-1) for x in xs]
        old_blocks, out_blocks = old.view(-1, c, rest), out.view(-1, c, rest)  # first-axis blocks
        # on a GPU a slab per launch would multiply the kernel launches, which bound its step: one slab
        slab = SLAB_NUMEL if old.device.type == "cpu" else total
        per = max(1, slab // (c * rest)) * c * rest
        for lo in range(0, total, per):
            hi = min(total, lo + per)
            within = lo // n == (hi - 1) // n  # the slab lies in one tensor
            if within and not inner:  # nothing to transform first
                z = flats[lo // n][lo % n : lo % n + hi - lo]
            elif within and last_only and onednn:  # oneDNN's output is the slab, no copy
                start, stop = lo % n // last, (lo % n + hi - lo) // last
                z = self._forward_rows(rows[lo // n][start:stop], last, None, onednn)
            else:
                z = self._workspace("forward", (hi - lo,), old)
                if last_only:
                    z_rows = z.view(-1, last)
                for i, start, end, at in self._slab_parts(lo, hi, n):
                    if last_only:
                        dest = z_rows[at // last : (at + end - start) // last]
                        y = self._forward_rows(rows[i][start // last : end // last], last, dest, onednn)
                        if y is not dest:
                            dest.copy_(y)
                    elif not inner:
                        z[at : at + end - start].copy_(flats[i][start:end])
                    else:
                        piece = z[at : at + end - start]
                        part = flats[i][start:end].view(-1, *shape[1:])
                        y = self._apply(part, tuple(part.shape), chunk, inverse=False, first_axis=1, out=piece)
                        if y.data_ptr() != piece.data_ptr():
                            piece.view(part.shape).copy_(y)
            blocks = slice(lo // (c * rest), hi // (c * rest))
            self._first_axis_accumulate(z.view(-1, c, rest), old_blocks[blocks], out_blocks[blocks], decay, scale)
        return False

    @staticmethod
    def first_and_last_only(chunk: tuple[int, ...]) -> bool:
        """Whether chunks span the first and the last axis and no other (a matrix's case)."""
        return len(chunk) > 1 and chunk[0] > 1 and chunk[-1] > 1 and all(c == 1 for c in chunk[1:-1])

    @classmethod
    def fills_peaks(cls, chunk: tuple[int, ...], like: torch.Tensor) -> bool:
        """Whether ``accumulate`` into tensors like ``like`` takes a path that fills ``peaks``: the
        native kernel's or the oneDNN matrix path (``_accumulate_onednn``)."""
        return cls._native(chunk, like) or (_onednn_computes(like) and cls.first_and_last_only(chunk))

    @staticmethod
    def _native(chunk: tuple[int, ...], like: torch.Tensor) -> bool:
        """Whether the C kernel (``native``) takes the transform: float32 CPU matrices of 64 x 64
        chunks. It is about as fast as oneDNN's GEMMs in bf16 (README) and float32-accurate, so the
        bf16 opt-in (``onednn_gemm_dtype``) acts on the GEMM path only."""
        return native.handles(chunk, like)

    def _accumulate_onednn(self, xs, chunk, old, out, decay, scale, peaks=None):
        """``accumulate`` for tensors whose chunks span the first and the last axis only (matrices),
        with both GEMMs by oneDNN, which has no batched product with a shared left factor: each slab
        of first-axis blocks is copied first-axis-major, (c, blocks, rest), so the last-axis product
        keeps that order and the first-axis product is one plain GEMM, D @ (c, blocks * rest), whose
        right factor oneDNN reads through a transposed view. The sum with ``decay * old`` (a copy when
        ``old`` is None) reads the result back through a view in the tensors' own layout. Against
        the last-axis GEMM by oneDNN and ``baddbmm`` (MKL): the step 14-16% faster at 1 thread, 1-12% at
        2 (A/B runs, this AMD CPU). oneDNN's op has no ``out=``: each slab allocates two slab-sized
        tensors (no page faults here). With ``peaks``, each slab's run peaks are taken right after its
        sum, from cache (|x| into a workspace, then ``amax``): the step 1-3% faster than two passes
        over the whole momentum later (A/B, 1 and 2 threads).

        Where the user allows bf16 (``onednn_gemm_dtype``), the slab is copied into bf16 and both
        products run in bf16 (oneDNN accumulates in float32, then rounds the product to bf16), so
        each step's DCT of the gradient is off by ~0.4% (relative, random data) before its sum into
        the float32 momentum."""
        c, last = chunk[0], chunk[-1]
        rest = xs[0].numel() // xs[0].shape[0]
        blocks = [x.reshape(-1, c, rest) for x in xs]
        per_tensor = blocks[0].shape[0]
        out_blocks = out.view(-1, c, rest)
        old_blocks = None if old is None else old.view(-1, c, rest)
        gemm = onednn_gemm_dtype()
        first = self._basis(c, out)
        first = (first * scale if scale != 1 else first).to(gemm)
        basis = self._onednn_basis(last, out, dtype=gemm)
        per = max(1, SLAB_NUMEL // (c * rest))
        runs_per_block = c * rest // last
        for lo in range(0, len(xs) * per_tensor, per):
            hi = min(len(xs) * per_tensor, lo + per)
            slab = self._workspace("forward", (c, hi - lo, rest), out, dtype=gemm)
            for i, start, end, at in self._slab_parts(lo, hi, per_tensor):
                slab[:, at : at + end - start].copy_(blocks[i][start:end].transpose(0, 1))
            z = _ONEDNN_LINEAR(slab.view(-1, last), basis, None, "none", [], "")
            y = _ONEDNN_LINEAR(first, z.view(c, -1).T, None, "none", [], "")
            del z
            y = y.view(c, hi - lo, rest).transpose(0, 1)
            if old_blocks is None:
                out_blocks[lo:hi].copy_(y)
            else:
                torch.add(y, old_blocks[lo:hi], alpha=decay, out=out_blocks[lo:hi])
            if peaks is not None:
                scratch = self._workspace("peaks", (hi - lo, c, rest), out)
                magnitude = torch.abs(out_blocks[lo:hi], out=scratch).view(-1, last)
                torch.amax(magnitude, 1, out=peaks[lo * runs_per_block : hi * runs_per_block])

    @staticmethod
    def _slab_parts(lo: int, hi: int, n: int):
        """(tensor, start, end, offset in the slab) of each piece of consecutive tensors of ``n``
        elements that the flat range [lo, hi) covers."""
        pos = lo
        while pos < hi:
            i, start = divmod(pos, n)
            end = min(n, start + hi - pos)
            yield i, start, end, pos - lo
            pos += end - start

    def _first_axis_accumulate(self, z, old, out, decay, scale):
        """``out = decay * old + scale * (D along the first axis) z``, all (blocks, c, rest)."""
        b, c, rest = out.shape
        if c == 1:
            torch.mul(old, decay, out=out).add_(z, alpha=scale)
        elif rest == 1:
            basis_t = self._basis(c, old, transposed=True)
            torch.addmm(old.view(b, c), z.view(b, c), basis_t, beta=decay, alpha=scale, out=out.view(b, c))
        else:
            torch.baddbmm(old, self._batched_basis(c, b, rest, old), z, beta=decay, alpha=scale, out=out)

    @staticmethod
    def blocked_shape(shape: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[int, ...]:
        """(n_1/c_1, c_1, ..., n_d/c_d, c_d): a contiguous tensor of ``shape`` viewed chunk by chunk."""
        return tuple(s for n, c in zip(tuple(shape) or (1,), chunk) for s in (n // c, c))

    def forward(self, x: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """DCT of every chunk of ``x``, left in ``x``'s own layout (element [i, j] of a 2-D tensor is
        coefficient (i mod c_1, j mod c_2) of chunk (i // c_1, j // c_2)). May return ``x`` itself when
        no dimension is transformed."""
        if self.fills_peaks(chunk, x):  # the native kernel or the oneDNN matrix path
            out = torch.empty(x.shape, dtype=x.dtype)
            self.accumulate([x], chunk, None, out.view(-1), decay=0.0, scale=1.0)
            return out
        return self._apply(x, tuple(x.shape) or (1,), chunk, inverse=False)

    def inverse(self, y: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """Inverse of ``forward``: coefficients in the tensor's own layout back to the tensor."""
        return self._apply(y, tuple(y.shape) or (1,), chunk, inverse=True).reshape(y.shape)

    @classmethod
    def chunk_major(cls, y: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """``forward``'s output as (b_1, ..., b_d, c_1, ..., c_d): chunk-major, a view where possible."""
        d = len(chunk)
        blocked = y.reshape(cls.blocked_shape(tuple(y.shape), chunk))
        return blocked.permute(*range(0, 2 * d, 2), *range(1, 2 * d, 2))

    @classmethod
    def own_layout_is_chunk_major(cls, shape: tuple[int, ...], chunk: tuple[int, ...]) -> bool:
        """True when a tensor's own layout already lists its chunks one after the other (1-D
        tensors, or all blocks but the first of size 1), so coefficient rows need no copy."""
        return cls.chunk_major(torch.empty(tuple(shape) or (1,), device="meta"), chunk).is_contiguous()

    @staticmethod
    def run_rows(shape: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
        """(num_chunks, chunk_numel // c_d): for each chunk (chunk-major order) and each of its runs
        of c_d coefficients along the last axis (in the chunk's own row-major order), that run's
        row in the tensor's own layout viewed as (numel // c_d, c_d)."""
        shape = tuple(shape) or (1,)
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        base = torch.zeros((), dtype=torch.long)
        offs = torch.zeros((), dtype=torch.long)
        for i, (n, c) in enumerate(zip(shape, chunk)):
            base = base.unsqueeze(-1) + torch.arange(n // c) * (c * strides[i])
            if i < len(shape) - 1:
                offs = offs.unsqueeze(-1) + torch.arange(c) * strides[i]
        return (base.reshape(-1, 1) + offs.reshape(1, -1)) // chunk[-1]

    @classmethod
    def chunk_rows(cls, y: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """Coefficients in a tensor's own layout as (num_chunks, chunk_numel) rows (a copy unless
        ``own_layout_is_chunk_major``): the order the payload's indices refer to."""
        return cls.chunk_major(y.reshape(tuple(y.shape) or (1,)), chunk).reshape(-1, math.prod(chunk))

    def encode(self, x: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """DCT of every chunk of ``x``: a (num_chunks, chunk_numel) coefficient matrix."""
        return self.chunk_rows(self.forward(x, chunk), chunk)

    @classmethod
    def blocked(cls, y: torch.Tensor, full: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
        """Chunk-major rows (num_chunks, ...) as a view of shape ``blocked_shape(full, chunk)``."""
        shape, order = cls._blocked_view(tuple(full), tuple(chunk))
        return y.reshape(shape).permute(order)

    @classmethod
    @functools.lru_cache(maxsize=1024)
    def _blocked_view(cls, full: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[tuple, tuple]:
        """For ``blocked``: the chunk-major shape (b_1, ..., b_d, c_1, ..., c_d) and the permutation
        to (b_1, c_1, b_2, c_2, ...). Cached: a step asks for it once per tensor (~2 us of Python
        each time otherwise)."""
        d = len(chunk)
        blocks = cls.blocked_shape(full, chunk)[0::2]
        return blocks + chunk, tuple(i for pair in zip(range(d), range(d, 2 * d)) for i in pair)

    def unchunk(self, y: torch.Tensor, full: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
        """Chunk-major (num_chunks, c_1, ..., c_d) back to the tensor's own layout (a copy)."""
        return self.blocked(y, full, chunk).reshape(full)

    def decode(self, coeffs: torch.Tensor, shape: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
        """Inverse of ``encode``: coefficients (num_chunks, chunk_numel) back to a tensor of ``shape``."""
        full = tuple(shape) or (1,)
        return self._apply(self.unchunk(coeffs, full, chunk), full, chunk, inverse=True).reshape(shape)

    def _rows(self, n: int, like: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """Rows ``which`` (any shape) of D (n x n), shape ``(*which.shape, n)``: ``index_select``
        gathers whole rows ~9x faster here than indexing with a tensor."""
        return self._basis(n, like).index_select(0, which.reshape(-1)).view(*which.shape, n)

    def decode_many(self, idx: torch.Tensor, values: torch.Tensor, chunk, pieces):
        """Inverse DCT of stacked chunks given as (indices, values), both (num_chunks, m), repeated
        indices adding up; ``pieces`` = [(first row, end row, shape)] cuts the stack into tensors.

        Yields each tensor in turn in the blocked layout, shape ``blocked_shape(shape, chunk)``, as a
        view that is not necessarily contiguous: a contiguous tensor of ``shape`` viewed the same way
        lines up element for element, so an update needs no copy back to the tensor's own layout.
        A yielded view may share a workspace of this transform: use it before asking for the next.

        With few coefficients per chunk (m < the sum of the chunk's sides) each chunk is a product of
        its m first-axis basis rows and m last-axis basis rows (a batched GEMM with inner size m),
        cheaper than the dense inverse; otherwise the dense inverse. On the CPU that GEMM runs on
        consecutive pieces of about ``SLAB_NUMEL`` elements at a time, into one workspace, so the
        update reads each piece back from cache (the whole step 3-6% faster here than one GEMM over
        the stack: torch's kernel for inner size m is slow to write a large output)."""
        if len(chunk) > 2 or idx.shape[1] >= sum(chunk):
            dense = torch.zeros(idx.shape[0], math.prod(chunk), dtype=values.dtype, device=values.device)
            dense.scatter_add_(1, idx, values)
            for a, b, shape in pieces:
                yield self.decode(dense[a:b], shape, chunk).view(self.blocked_shape(shape, chunk))
            return
        last = self._rows(chunk[-1], values, idx % chunk[-1]) * values.unsqueeze(-1)  # (B, m, c_last)
        if len(chunk) == 1:
            y = last.sum(1)
            for a, b, shape in pieces:
                yield self.blocked(y[a:b], tuple(shape) or (1,), chunk)
            return
        first = self._rows(chunk[0], values, idx // chunk[-1]).transpose(1, 2)  # (B, c_first, m)
        per = SLAB_NUMEL // math.prod(chunk) if values.device.type == "cpu" else idx.shape[0]
        for group in self._slab_pieces(pieces, per):
            lo, hi = group[0][0], group[-1][1]
            y = self._workspace("inverse", (hi - lo, *chunk), values)
            torch.bmm(first[lo:hi], last[lo:hi], out=y)
            for a, b, shape in group:
                yield self.blocked(y[a - lo : b - lo], tuple(shape) or (1,), chunk)

    @staticmethod
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

    def decode_sparse(self, idx: torch.Tensor, values: torch.Tensor, shape, chunk) -> torch.Tensor:
        """``decode`` of one tensor's coefficients given as (indices, values) per chunk."""
        (blocked,) = self.decode_many(idx, values, chunk, [(0, idx.shape[0], shape)])
        return blocked.clone(memory_format=torch.contiguous_format).view(shape)  # its own memory, not the workspace
