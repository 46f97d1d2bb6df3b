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

    def _apply(self, y: torch.Tensor, shape: tuple[int, ...], chunk: tuple[int, ...], inverse: bool):
        """Multiply every chunk of every axis by D (forward) or D^T (inverse), in the tensor's own
        layout: the last axis as one large GEMM, the others as a batched D @ (c, rest) product, so
        no data moves between the per-axis products."""
        for axis, c in enumerate(chunk):
            if c == 1:
                continue
            basis = self._basis(c, y)
            rest = math.prod(shape[axis + 1 :])
            if rest == 1:
                y = y.reshape(-1, c) @ (basis if inverse else basis.T)
            else:
                y = torch.matmul(basis.T if inverse else basis, y.reshape(-1, c, rest))
        return y.reshape(shape)

    @staticmethod
    def _split(shape, chunk):
        blocks = [n // c for n, c in zip(shape, chunk)]
        return [s for pair in zip(blocks, chunk) for s in pair], len(shape)  # b1, c1, b2, c2, ...

    def encode(self, x: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """DCT of every chunk of ``x``: a (num_chunks, chunk_numel) coefficient matrix."""
        shape = tuple(x.shape) or (1,)
        y = self._apply(x, shape, chunk, inverse=False)
        split, d = self._split(shape, chunk)
        y = y.reshape(split).permute(*range(0, 2 * d, 2), *range(1, 2 * d, 2))
        return y.reshape(-1, math.prod(chunk))

    def unchunk(self, y: torch.Tensor, full: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
        """Chunk-major (num_chunks, c_1, ..., c_d) back to the tensor's own layout."""
        split, d = self._split(full, chunk)
        order = [i for pair in zip(range(d), range(d, 2 * d)) for i in pair]  # b1, c1, b2, c2, ...
        return y.reshape(*split[0::2], *split[1::2]).permute(*order).reshape(full)

    def decode(self, coeffs: torch.Tensor, shape: tuple[int, ...], chunk: tuple[int, ...]) -> torch.Tensor:
        """Inverse of ``encode``: coefficients (num_chunks, chunk_numel) back to a tensor of ``shape``."""
        full = tuple(shape) or (1,)
        return self._apply(self.unchunk(coeffs, full, chunk), full, chunk, inverse=True).reshape(shape)

    def decode_many(self, idx: torch.Tensor, values: torch.Tensor, chunk, pieces) -> list[torch.Tensor]:
        """Inverse DCT of stacked chunks given as (indices, values), both (num_chunks, m), repeated
        indices adding up; ``pieces`` = [(first row, end row, shape)] cuts the stack into tensors.

        With few coefficients per chunk (m < the sum of the chunk's sides) each chunk is the sum of
        its m basis outer products, cheaper than the dense inverse; otherwise the dense inverse."""
        if len(chunk) > 2 or idx.shape[1] >= sum(chunk):
            dense = torch.zeros(idx.shape[0], math.prod(chunk), dtype=values.dtype, device=values.device)
            dense.scatter_add_(1, idx, values)
            return [self.decode(dense[a:b], shape, chunk) for a, b, shape in pieces]
        last = self._basis(chunk[-1], values)[idx % chunk[-1]] * values.unsqueeze(-1)  # (B, m, c_last)
        if len(chunk) == 1:
            y = last.sum(1)
        else:
            first = self._basis(chunk[0], values)[idx // chunk[-1]]  # (B, m, c_first)
            y = first.transpose(1, 2) @ last
        return [self.unchunk(y[a:b], tuple(shape) or (1,), chunk).reshape(shape) for a, b, shape in pieces]

    def decode_sparse(self, idx: torch.Tensor, values: torch.Tensor, shape, chunk) -> torch.Tensor:
        """``decode`` of one tensor's coefficients given as (indices, values) per chunk."""
        return self.decode_many(idx, values, chunk, [(0, idx.shape[0], shape)])[0]
