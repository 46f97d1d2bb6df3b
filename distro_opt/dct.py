"""Chunked orthonormal DCT-II: the chunking, the basis, and where coefficients sit in memory.

DeMo's transform (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870, Sec. 3). A tensor of shape
(n_1, ..., n_d) is cut into chunks of shape (c_1, ..., c_d), where c_i is the largest divisor of n_i
that is <= the target chunk (n_i itself when n_i <= target; a prime n_i > target gives c_i = 1, no
transform along that dim). Every chunk gets a separable d-dimensional DCT-II with the orthonormal
basis D_c[k, n] = sqrt(2/c) * a_k * cos(pi * (2n + 1) * k / (2c)), a_0 = 1/sqrt(2), a_k = 1
otherwise (scipy.fft.dct(type=2, norm="ortho")). Being orthonormal, the inverse is D_c^T.

Two layouts of a tensor's coefficients:

* its *own layout*, what the transform writes: element [i, j] of a matrix is coefficient
  (i mod c_1, j mod c_2) of chunk (i // c_1, j // c_2). The momentum is kept this way, so the
  transform needs no permutation pass; a chunk's coefficients are then runs along the last axis
  (``run_rows``), which top-k reads in place.
* *chunk rows*, (num_chunks, chunk_numel): chunk-major, the order the payload's indices refer to.

``reference.py`` uses only this module: the plain version of the step.
"""
from __future__ import annotations

import functools
import math

import torch


def chunk_size(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is <= ``target`` (``n`` itself when ``n <= target``)."""
    if n <= target:
        return n
    for c in range(target, 0, -1):
        if n % c == 0:
            return c
    return 1


def chunk_shape(shape: tuple[int, ...], target: int) -> tuple[int, ...]:
    """Chunk shape of a tensor of ``shape``; a 0-d tensor is treated as shape (1,)."""
    return tuple(chunk_size(n, target) for n in (tuple(shape) or (1,)))


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n x n): ``D @ x`` is ``scipy.fft.dct(x, norm="ortho")``."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(dtype=dtype, device=device)


def first_and_last_only(chunk: tuple[int, ...]) -> bool:
    """Whether chunks span the first and the last axis and no other (a matrix's case)."""
    return len(chunk) > 1 and chunk[0] > 1 and chunk[-1] > 1 and all(c == 1 for c in chunk[1:-1])


def blocked_shape(shape: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[int, ...]:
    """(n_1/c_1, c_1, ..., n_d/c_d, c_d): a contiguous tensor of ``shape`` viewed chunk by chunk."""
    return tuple(s for n, c in zip(tuple(shape) or (1,), chunk) for s in (n // c, c))


def chunk_major(y: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
    """Coefficients in their own layout as (b_1, ..., b_d, c_1, ..., c_d): a view where possible."""
    d = len(chunk)
    blocked_view = y.reshape(blocked_shape(tuple(y.shape), chunk))
    return blocked_view.permute(*range(0, 2 * d, 2), *range(1, 2 * d, 2))


def own_layout_is_chunk_major(shape: tuple[int, ...], chunk: tuple[int, ...]) -> bool:
    """True when a tensor's own layout already lists its chunks one after the other (1-D tensors,
    or all blocks but the first of size 1), so coefficient rows need no copy."""
    return chunk_major(torch.empty(tuple(shape) or (1,), device="meta"), chunk).is_contiguous()


def chunk_rows(y: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
    """Coefficients in a tensor's own layout as (num_chunks, chunk_numel) rows (a copy unless
    ``own_layout_is_chunk_major``)."""
    return chunk_major(y.reshape(tuple(y.shape) or (1,)), chunk).reshape(-1, math.prod(chunk))


@functools.lru_cache(maxsize=1024)
def _blocked_view(full: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[tuple, tuple]:
    """For ``blocked``: the chunk-major shape (b_1, ..., b_d, c_1, ..., c_d) and the permutation to
    (b_1, c_1, b_2, c_2, ...). Cached: a step asks for it once per tensor."""
    d = len(chunk)
    blocks = blocked_shape(full, chunk)[0::2]
    return blocks + chunk, tuple(i for pair in zip(range(d), range(d, 2 * d)) for i in pair)


def blocked(y: torch.Tensor, full: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
    """Chunk rows (num_chunks, ...) as a view of shape ``blocked_shape(full, chunk)``."""
    shape, order = _blocked_view(tuple(full), tuple(chunk))
    return y.reshape(shape).permute(order)


def unchunk(y: torch.Tensor, full: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
    """Chunk rows back to the tensor's own layout (a copy)."""
    return blocked(y, full, chunk).reshape(full)


def run_rows(shape: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
    """(num_chunks, chunk_numel // c_d): for each chunk (chunk-major order) and each of its runs of
    c_d coefficients along the last axis (in the chunk's own row-major order), that run's row in the
    tensor's own layout viewed as (numel // c_d, c_d)."""
    shape = tuple(shape) or (1,)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    base = torch.zeros((), dtype=torch.long)
    offs = torch.zeros((), dtype=torch.long)
    for i, (n, c) in enumerate(zip(shape, chunk)):
        base = base.unsqueeze(-1) + torch.arange(n // c) * (c * strides[i])
        if i < len(shape) - 1:
            offs = offs.unsqueeze(-1) + torch.arange(c) * strides[i]
    return (base.reshape(-1, 1) + offs.reshape(1, -1)) // chunk[-1]
