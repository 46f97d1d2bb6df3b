"""Per-row top-k by magnitude: the indices of the k largest |x| in every row of a matrix.

``torch.topk`` on CPU selects by a partial sort of every full row, which costs more than the rest of
a DisTrOAdamW step's elementwise work. For a small k of a long row, two cheaper passes find the
same set:

1. cut each row into groups of ``GROUP`` neighbours and take every group's largest |x|
   (``amax``/``amin`` reduce contiguous memory, no |x| is materialized);
2. the k groups with the largest maxima hold the row's k largest |x|: a group that holds one of
   them has a maximum at least as large as the k-th largest value, and at most k - 1 other groups
   can beat it. So a top-k over those k groups' k * GROUP values is the answer.

With ties at the k-th value either method may keep any of the tied entries. NaN propagates through
both steps the way ``torch.topk`` ranks it (first), so callers that check the kept values for
non-finite entries still see it.
"""
from __future__ import annotations

import torch

GROUP = 64


def uses_groups(numel: int, k: int) -> bool:
    """The grouped path pays off when the candidates are a small part of the row."""
    return numel % GROUP == 0 and 4 * k * GROUP <= numel


def group_peaks(groups: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dimension, without materializing |x| (step 1 above). On a GPU the
    inf-norm reduction does it in one pass; on the CPU it is much slower than ``amax`` + ``amin``."""
    if groups.device.type == "cuda":
        return torch.linalg.vector_norm(groups, float("inf"), dim=-1)
    return torch.maximum(groups.amax(-1), groups.amin(-1).neg_())


def largest_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (rows, k), unsorted, of the k largest entries of every row of the 2-D ``x``, whose
    entries are >= 0 or NaN (NaN first, like ``torch.topk``); ``x`` is overwritten.

    For short rows on the CPU, k rounds of ``argmax`` and masking: torch's top-k has a high cost per
    element for rows of 128 or fewer. Ties may pick other entries than ``torch.topk`` would; either
    is a valid top-k."""
    rows, n = x.shape
    if x.device.type != "cpu" or n > 128 or k > 8:
        return x.topk(k, dim=1, sorted=False).indices
    out = torch.empty(rows, k, dtype=torch.long)
    for j in range(k):
        best = x.argmax(1, keepdim=True)
        out[:, j : j + 1] = best
        x.scatter_(1, best, -1.0)
    return out


def topk_abs_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (rows, k), unsorted, of the k largest |x| in every row of the 2-D ``x``."""
    rows, numel = x.shape
    if not uses_groups(numel, k):
        return x.abs().topk(k, dim=1, sorted=False).indices
    groups = x.view(rows, numel // GROUP, GROUP)
    peak = group_peaks(groups)  # (rows, groups)
    best = peak.topk(k, dim=1, sorted=False).indices  # (rows, k) group numbers
    candidates = groups.gather(1, best.unsqueeze(2).expand(rows, k, GROUP)).view(rows, k * GROUP)
    pick = candidates.abs_().topk(k, dim=1, sorted=False).indices  # positions among the candidates
    return best.gather(1, pick // GROUP) * GROUP + pick % GROUP


def topk_abs_in_runs(
    rows: torch.Tensor, run_rows: torch.Tensor, k: int, row_peaks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k by magnitude per chunk when chunks are scattered over the rows of ``rows``.

    ``rows`` (R, c) holds the coefficients in the tensors' own layout, a run of c along the last
    axis per row; ``run_rows`` (chunks, G) names each chunk's G runs in order (see
    ``DCTTransform.run_rows``); ``row_peaks`` (R,), when given, holds each row's largest |x|.
    Steps 1-2 above with the runs as groups: the k runs with the largest peaks are the candidates.
    Returns (indices within each chunk, chunk-major, and positions in ``rows.view(-1)``), both
    (chunks, k)."""
    chunks, runs = run_rows.shape
    c = rows.shape[1]
    if k < runs:
        row_peaks = group_peaks(rows) if row_peaks is None else row_peaks
        peaks = row_peaks.index_select(0, run_rows.view(-1)).view(chunks, runs)  # index_select: faster than [run_rows]
        best = largest_indices(peaks, k)  # (chunks, k) run numbers
    else:  # every run is a candidate
        best = torch.arange(runs, device=rows.device).expand(chunks, runs)
    picked_rows = run_rows.gather(1, best)
    candidates = rows.index_select(0, picked_rows.reshape(-1)).view(chunks, -1)
    pick = candidates.abs_().topk(k, dim=1, sorted=False).indices
    run, offset = pick // c, pick % c
    return best.gather(1, run) * c + offset, picked_rows.gather(1, run) * c + offset
