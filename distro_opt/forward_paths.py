"""The GEMM paths of the forward transform's decayed sum, ``out = decay * old + scale * DCT(x)``.

``DCTTransform.accumulate`` picks one path (``DCTTransform.forward_path``): the C kernel
(``native.py``), ``accumulate_onednn`` for float32 CPU matrices, or ``accumulate_slabs`` for every
other case. Both here work in slabs of whole first-axis blocks of about ``gemm.SLAB_NUMEL``
elements on the CPU, so the intermediate between the axes is read back while it is still in cache.
"""
from __future__ import annotations

import math

import torch

from . import gemm as gemm_module
from .gemm import GemmDCT, onednn_computes, onednn_gemm_dtype, onednn_linear


def slab_parts(lo: int, hi: int, n: int):
    """(tensor, start, end, offset in the slab) of each piece of consecutive tensors of ``n``
    elements that the flat range [lo, hi) covers."""
    pos = lo
    while pos < hi:
        i, start = divmod(pos, n)
        end = min(n, start + hi - pos)
        yield i, start, end, pos - lo
        pos += end - start


def accumulate_slabs(gemm: GemmDCT, xs, chunk, old, out, decay: float, scale: float) -> None:
    """All axes but the first are transformed into a workspace, then the first axis and the sum are
    one batched GEMM over the slab (``baddbmm`` with beta = decay). On a GPU the whole run is one
    slab: a slab per launch would multiply the kernel launches, which bound its step."""
    shape = tuple(xs[0].shape) or (1,)
    n, total = math.prod(shape), len(xs) * math.prod(shape)
    c, rest = chunk[0], n // shape[0]
    inner = [axis for axis in range(1, len(chunk)) if chunk[axis] > 1]  # transformed before the first
    last_only = inner == [len(chunk) - 1]
    onednn = onednn_computes(out)
    if last_only:  # the last axis alone (a matrix's case): one GEMM per part, on rows of that axis
        last = chunk[-1]
        rows = [x.reshape(-1, last) for x in xs]
    else:
        flats = [x.reshape(-1) for x in xs]
    old_blocks, out_blocks = old.view(-1, c, rest), out.view(-1, c, rest)  # first-axis blocks
    slab = gemm_module.SLAB_NUMEL if old.device.type == "cpu" else total
    per = max(1, slab // (c * rest)) * c * rest
    for lo in range(0, total, per):
        hi = min(total, lo + per)
        within = lo // n == (hi - 1) // n  # the slab lies in one tensor
        if within and not inner:  # nothing to transform first
            z = flats[lo // n][lo % n : lo % n + hi - lo]
        elif within and last_only and onednn:  # oneDNN's output is the slab, no copy
            start, stop = lo % n // last, (lo % n + hi - lo) // last
            z = gemm.forward_rows(rows[lo // n][start:stop], last, None, onednn)
        else:
            z = gemm.workspace("forward", (hi - lo,), old)
            if last_only:
                z_rows = z.view(-1, last)
            for i, start, end, at in slab_parts(lo, hi, n):
                if last_only:
                    dest = z_rows[at // last : (at + end - start) // last]
                    y = gemm.forward_rows(rows[i][start // last : end // last], last, dest, onednn)
                    if y is not dest:
                        dest.copy_(y)
                elif not inner:
                    z[at : at + end - start].copy_(flats[i][start:end])
                else:
                    piece = z[at : at + end - start]
                    part = flats[i][start:end].view(-1, *shape[1:])
                    y = gemm.apply(part, tuple(part.shape), chunk, inverse=False, first_axis=1, out=piece)
                    if y.data_ptr() != piece.data_ptr():
                        piece.view(part.shape).copy_(y)
        blocks = slice(lo // (c * rest), hi // (c * rest))
        _first_axis_accumulate(gemm, z.view(-1, c, rest), old_blocks[blocks], out_blocks[blocks], decay, scale)


def _first_axis_accumulate(gemm: GemmDCT, z, old, out, decay, scale) -> None:
    """``out = decay * old + scale * (D along the first axis) z``, all (blocks, c, rest)."""
    b, c, rest = out.shape
    if c == 1:
        torch.mul(old, decay, out=out).add_(z, alpha=scale)
    elif rest == 1:
        basis_t = gemm.basis(c, old, transposed=True)
        torch.addmm(old.view(b, c), z.view(b, c), basis_t, beta=decay, alpha=scale, out=out.view(b, c))
    else:
        torch.baddbmm(old, gemm.batched_basis(c, b, rest, old), z, beta=decay, alpha=scale, out=out)


def accumulate_onednn(gemm: GemmDCT, xs, chunk, old, out, decay, scale, peaks=None) -> None:
    """The path for tensors whose chunks span the first and the last axis only (matrices), with
    both GEMMs by oneDNN, which has no batched product with a shared left factor: each slab of
    first-axis blocks is copied first-axis-major, (c, blocks, rest), so the last-axis product keeps
    that order and the first-axis product is one plain GEMM, D @ (c, blocks * rest), whose right
    factor oneDNN reads through a transposed view. The sum with ``decay * old`` (a copy when ``old``
    is None) reads the result back through a view in the tensors' own layout. With ``peaks``, each
    slab's run peaks are taken right after its sum, from cache.

    Where the user allows bf16 (``onednn_gemm_dtype``), the slab is copied into bf16 and both
    products run in bf16 (oneDNN accumulates in float32, then rounds the product to bf16), so each
    step's DCT of the gradient is off by ~0.4% before its sum into the float32 momentum."""
    c, last = chunk[0], chunk[-1]
    rest = xs[0].numel() // xs[0].shape[0]
    blocks = [x.reshape(-1, c, rest) for x in xs]
    per_tensor = blocks[0].shape[0]
    out_blocks = out.view(-1, c, rest)
    old_blocks = None if old is None else old.view(-1, c, rest)
    dtype = onednn_gemm_dtype()
    first = gemm.basis(c, out)
    first = (first * scale if scale != 1 else first).to(dtype)
    basis = gemm.onednn_basis(last, out, dtype=dtype)
    per = max(1, gemm_module.SLAB_NUMEL // (c * rest))
    runs_per_block = c * rest // last
    for lo in range(0, len(xs) * per_tensor, per):
        hi = min(len(xs) * per_tensor, lo + per)
        slab = gemm.workspace("forward", (c, hi - lo, rest), out, dtype=dtype)
        for i, start, end, at in slab_parts(lo, hi, per_tensor):
            slab[:, at : at + end - start].copy_(blocks[i][start:end].transpose(0, 1))
        z = onednn_linear(slab.view(-1, last), basis)
        y = onednn_linear(first, z.view(c, -1).T)
        del z
        y = y.view(c, hi - lo, rest).transpose(0, 1)
        if old_blocks is None:
            out_blocks[lo:hi].copy_(y)
        else:
            torch.add(y, old_blocks[lo:hi], alpha=decay, out=out_blocks[lo:hi])
        if peaks is not None:
            scratch = gemm.workspace("peaks", (hi - lo, c, rest), out)
            magnitude = torch.abs(out_blocks[lo:hi], out=scratch).view(-1, last)
            torch.amax(magnitude, 1, out=peaks[lo * runs_per_block : hi * runs_per_block])
