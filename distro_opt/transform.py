"""Chunked orthonormal DCT-II, DeMo's transform (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870, Sec. 3).

A tensor of shape (n_1, ..., n_d) is cut into chunks of shape (c_1, ..., c_d), where c_i is the
largest divisor of n_i that is <= the target chunk (n_i itself when n_i <= target; a prime n_i >
target gives c_i = 1, no transform along that dim). Every chunk gets a separable d-dimensional DCT-II
with the orthonormal basis D_c[k, n] = sqrt(2/c) * a_k * cos(pi * (2n + 1) * k / (2c)), a_0 = 1/sqrt(2),
a_k = 1 otherwise (scipy.fft.dct(type=2, norm="ortho")). Being orthonormal, the inverse is D_c^T.

Coefficients come out chunk-major, as a (num_chunks, chunk_numel) matrix, so that a per-chunk top-k
is one ``torch.topk(..., dim=1)``.
"""
from __future__ import annotations

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

    @staticmethod
    def chunk_shape(shape: tuple[int, ...], target: int) -> tuple[int, ...]:
        """Chunk shape of a tensor of ``shape``; a 0-d tensor is treated as shape (1,)."""
        return tuple(chunk_size(n, target) for n in (tuple(shape) or (1,)))

    def _basis(self, n: int, like: torch.Tensor) -> torch.Tensor:
        key = (n, like.dtype, like.device)
        if key not in self._bases:
            self._bases[key] = dct_matrix(n, like.dtype, like.device)
        return self._bases[key]

    def _apply(self, y: torch.Tensor, chunk: tuple[int, ...], inverse: bool) -> torch.Tensor:
        """Multiply every chunk axis (axes 1..d of ``y``) by D (forward) or D^T (inverse)."""
        d = len(chunk)
        for axis, c in enumerate(chunk, start=1):
            if c == 1:
                continue
            basis = self._basis(c, y)
            mat = basis if inverse else basis.T  # row-vector form: y @ D^T applies D
            if axis == d:
                y = y @ mat
            else:
                y = (y.movedim(axis, -1) @ mat).movedim(-1, axis)
        return y

    def encode(self, x: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """DCT of every chunk of ``x``: a (num_chunks, chunk_numel) coefficient matrix."""
        shape = tuple(x.shape) or (1,)
        blocks = [n // c for n, c in zip(shape, chunk)]
        d = len(shape)
        split = [s for pair in zip(blocks, chunk) for s in pair]  # b1, c1, b2, c2, ...
        y = x.reshape(split).permute(*range(0, 2 * d, 2), *range(1, 2 * d, 2))
        y = y.reshape(-1, *chunk)
        return self._apply(y, chunk, inverse=False).reshape(y.shape[0], -1)

    def decode(self, coeffs: torch.Tensor, shape: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
        """Inverse of ``encode``: coefficients (num_chunks, chunk_numel) back to a tensor of ``shape``."""
        full = tuple(shape) or (1,)
        blocks = [n // c for n, c in zip(full, chunk)]
        d = len(full)
        y = self._apply(coeffs.reshape(-1, *chunk), chunk, inverse=True)
        y = y.reshape(*blocks, *chunk)
        order = [i for pair in zip(range(d), range(d, 2 * d)) for i in pair]  # b1, c1, b2, c2, ...
        return y.permute(*order).reshape(shape)
