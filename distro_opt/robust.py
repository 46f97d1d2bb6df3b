"""A robust replacement for DeMo's aggregate, for runs whose contributors are not all trusted.

DeMo's aggregate (``step.aggregate``) averages each DCT coefficient over the workers that kept it.
That divisor is what makes it unsafe with strangers: a coefficient that only a rogue keeps (a DC
coefficient nobody else selects) is the rogue's value undiluted, however large, and a sign update
follows it everywhere. Clipping the rogue's norm does not help while nobody else's value shares
that coefficient.

Here each coefficient is the coordinate-wise trimmed mean over *all* N contributors, a contributor
that did not keep the coefficient counting as 0 (Yin, Chen, Ramchandran, Bartlett 2018, "Byzantine-
robust distributed learning: towards optimal statistical rates", arXiv 1803.01498, Eq. 4):

    b = min(max(1, floor(f * N)), (N - 1) // 2)          f = the backend's ``untrusted_fraction``
    agg[c] = mean of the values x_1[c] .. x_N[c] after dropping the b smallest and the b largest

Bound: if at most b of the N contributors are rogues, every agg[c] lies between the smallest and
the largest honest value of coefficient c (zeros included), whatever the rogues send, because
after the trim each side keeps at least one honest value beyond any rogue value that survived.
So a rogue can neither put energy where no honest worker has any (the honest range is 0 there),
nor scale or flip a coefficient beyond the honest values' range. With N = 2 nothing is trimmed (b = 0): two peers cannot tell which
of them is the rogue.

Cost: the trim also drops honest values, so a coefficient kept by at most b workers (with one sign)
is lost, and one kept by few is shrunk toward 0; when all N kept it with the same value the result
is that value. Memory is one dense (N, chunks, coefficients) tensor per segment.
"""

from __future__ import annotations

import torch


def trim_count(num_contributors: int, untrusted_fraction: float) -> int:
    """How many values each side of a coefficient's sorted list drops: at least one, at most what
    still leaves one value in the middle."""
    wanted = max(1, int(untrusted_fraction * num_contributors))
    return max(0, min(wanted, (num_contributors - 1) // 2))


def trimmed_mean_aggregate(seg, contributions, like: torch.Tensor, untrusted_fraction: float, to_device):
    """The trimmed mean above for one segment, in ``step.aggregate``'s sparse form: (indices,
    weights) per chunk with repeats, every repeat of a coefficient weighted agg[c] / its count, so
    that the repeats add up to agg[c]. A contributor's repeated index (a rogue may send one) sets
    its value once, it never adds up."""
    dev, dtype = like.device, like.dtype
    n = len(contributions)
    dense = torch.zeros(n, seg.num_chunks, seg.chunk_numel, dtype=dtype, device=dev)
    for row, (i, v) in zip(dense, contributions):
        row.scatter_(1, to_device(i, dev), to_device(v.to(dtype), dev))
    b = trim_count(n, untrusted_fraction)
    kept = dense.sort(dim=0).values[b : n - b].mean(dim=0)
    idx = to_device(torch.cat([i for i, _ in contributions], dim=1), dev)
    count = torch.zeros_like(kept).scatter_add_(1, idx, torch.ones(idx.shape, dtype=dtype, device=dev))
    return idx, kept.gather(1, idx) / count.gather(1, idx)
