"""The step written plainly: a newcomer's first read, and what the tests hold the fast step to.

DeMo (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870, Algorithm 1) for one parameter and all of its
workers at once, with dense DCT matrices and the momentum kept in the spatial domain, as in the
paper. No segments, no own-layout coefficients, no kernels, no wire format: values travel exactly
(``compression_bits=64`` in the optimizers). ``step.py`` computes the same with the speed-ups; for
float64 parameters the two agree to rounding, but for the sign of a direction that rounds to 0.

    for every worker w:   Delta_w = beta * Delta_w + s * g_w
                          q_w     = top-k per chunk of DCT(Delta_w)
                          Delta_w = Delta_w - IDCT(q_w)                 (error feedback)
    everyone:             Q = per coefficient, the mean over the workers that kept it
                          p = p * (1 - lr * wd) - lr * sign(IDCT(Q))

(beta = compression_decay; s = lr in DeMo, 1 in DisTrOAdamW.)
"""
from __future__ import annotations

import math

import torch

from .dct import chunk_rows, chunk_shape, dct_matrix, unchunk


def to_chunks(x: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
    """``x`` cut into chunks: (num_chunks, c_1, ..., c_d), chunks in row-major order of their blocks."""
    return chunk_rows(x, chunk).reshape(-1, *chunk)


def from_chunks(chunks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``to_chunks``."""
    return unchunk(chunks, tuple(shape) or (1,), tuple(chunks.shape[1:])).reshape(shape)


def dct_of_chunks(chunks: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The orthonormal DCT-II (or its inverse) of every chunk along every chunk axis."""
    y = chunks
    for axis in range(1, chunks.dim()):
        basis = dct_matrix(chunks.shape[axis], chunks.dtype, chunks.device)
        basis = basis.T if inverse else basis
        y = torch.movedim(torch.tensordot(basis, y, dims=([1], [axis])), 0, axis)
    return y


def compress(delta: torch.Tensor, chunk: tuple[int, ...], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values), both (num_chunks, k): the k largest-magnitude DCT coefficients of every
    chunk of ``delta``, which loses what it sent (error feedback)."""
    coeffs = dct_of_chunks(to_chunks(delta, chunk)).reshape(-1, math.prod(chunk))
    idx = coeffs.abs().topk(k, dim=1).indices
    values = coeffs.gather(1, idx)
    sent = torch.zeros_like(coeffs).scatter_(1, idx, values).reshape(-1, *chunk)
    delta.sub_(from_chunks(dct_of_chunks(sent, inverse=True), delta.shape))
    return idx, values


def aggregate(contributions, num_chunks: int, chunk: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Dense (num_chunks, c_1, ..., c_d) coefficients: each one the mean of the values of the
    workers that kept it, 0 where none did."""
    total = torch.zeros(num_chunks, math.prod(chunk), dtype=like.dtype, device=like.device)
    count = torch.zeros_like(total)
    for idx, values in contributions:
        total.scatter_add_(1, idx, values.to(like.dtype))
        count.scatter_add_(1, idx, torch.ones_like(values, dtype=like.dtype))
    return (total / count.clamp_min(1)).reshape(-1, *chunk)


def demo_step(p, grads, deltas, *, lr, weight_decay, compression_decay, compression_topk, compression_chunk,
              input_scale) -> torch.Tensor:
    """One step of parameter ``p`` (a plain tensor, updated in place) over the workers whose
    gradients are ``grads`` and spatial-domain momenta ``deltas`` (updated in place), with the sign
    update. Returns the aggregated direction U (before its sign)."""
    chunk = chunk_shape(tuple(p.shape), compression_chunk)
    k = min(compression_topk, math.prod(chunk))
    sent = []
    for g, delta in zip(grads, deltas):
        delta.mul_(compression_decay).add_(g, alpha=input_scale)
        sent.append(compress(delta, chunk, k))
    num_chunks = max(1, p.numel()) // math.prod(chunk)
    direction = from_chunks(dct_of_chunks(aggregate(sent, num_chunks, chunk, p), inverse=True), p.shape)
    p.mul_(1 - lr * weight_decay).sub_(lr * torch.sign(direction))
    return direction
