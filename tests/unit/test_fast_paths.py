"""Fast paths held to the plain computation they stand in for: the grouped top-k against
torch.topk on |x|, and run peaks taken during the transform against a separate pass. These tests
reach the library's internal modules (topk, transform, momentum) by name."""
import pytest
import torch

from distro_opt import DisTrOAdamW
from distro_opt.topk import largest_indices, topk_abs_in_runs, topk_abs_indices, uses_groups
from distro_opt.transform import DCTTransform


@pytest.mark.parametrize("numel, k", [(4096, 1), (4096, 4), (4096, 16), (1024, 4), (64, 4), (4096, 32), (3000, 4)])
def test_same_set_as_torch_topk_of_abs(numel, k):
    x = torch.randn(37, numel, generator=torch.Generator().manual_seed(numel + k), dtype=torch.float64)
    ours = topk_abs_indices(x, k).sort(dim=1).values
    reference = x.abs().topk(k, dim=1).indices.sort(dim=1).values
    assert torch.equal(ours, reference)


def test_both_paths_are_exercised_by_the_cases_above():
    assert uses_groups(4096, 4) and uses_groups(1024, 4)
    assert not uses_groups(4096, 32) and not uses_groups(64, 4) and not uses_groups(3000, 4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_value_is_kept_so_callers_can_see_it(bad):
    x = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0))
    x[1, 1234] = bad
    kept = x.gather(1, topk_abs_indices(x, 4))
    assert not torch.isfinite(kept[1]).all()
    assert torch.isfinite(kept[[0, 2]]).all()


@pytest.mark.parametrize("shape, chunk, k", [((128, 192), (64, 64), 4), ((96, 80), (16, 16), 5), ((32, 48), (16, 16), 20),
                                             ((16, 32, 48), (16, 16, 16), 6)])
def test_top_k_over_runs_of_scattered_chunks_is_torch_topk_of_each_chunk(shape, chunk, k):
    """Chunks left in the tensor's own layout (rows of one chunk far apart), including k >= runs."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    idx, pos = topk_abs_in_runs(x.reshape(-1, chunk[-1]), DCTTransform.run_rows(shape, chunk), k)
    rows = DCTTransform.chunk_major(x, chunk).reshape(idx.shape[0], -1)  # chunk-major copy for the reference
    reference = rows.abs().topk(k, dim=1).indices
    assert torch.equal(idx.sort(dim=1).values, reference.sort(dim=1).values)
    assert torch.equal(x.reshape(-1)[pos], rows.gather(1, idx))  # positions point at the same values


@pytest.mark.parametrize("n, k", [(64, 4), (128, 8), (16, 1), (256, 4), (64, 9)])  # the last two: torch.topk
def test_largest_indices_is_a_top_k(n, k):
    """The k largest of each row, NaN first; with ties, any entries whose values are a top-k's."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.rand(50, n, generator=g)
    x[3] = 0.5  # a row of ties
    x[15] = 0.0  # and of zeros (a run of zero coefficients has peak 0)
    x[7, :4] = x[7, 4]  # ties at the top
    x[9, 5] = float("nan")
    x[11, [2, 30 % n]] = float("inf")
    x[13, [1, 2]] = torch.tensor([float("inf"), float("nan")])  # NaN ranks above inf
    got = largest_indices(x.clone(), k)
    assert got.shape == (50, k)
    assert all(len(set(row.tolist())) == k for row in got)  # k distinct entries per row
    values = x.gather(1, got).nan_to_num(nan=4.0, posinf=3.0).sort(dim=1).values  # NaN ranks first
    reference = x.nan_to_num(nan=4.0, posinf=3.0).topk(k, dim=1).values.sort(dim=1).values
    assert torch.equal(values, reference)


def test_run_peaks_taken_during_the_transform_select_what_a_separate_pass_selects(monkeypatch):
    """On the CPU in float32 the forward transform hands the top-k each run's peak, taken from cache
    (``DCTTransform.accumulate(peaks=...)``). The steps must be bit-identical to ones where the top-k
    computes the peaks itself, over matrices that share slabs and one that spans several."""
    import distro_opt.optimizer as optimizer_module

    planned = []

    def run(with_peaks):
        def plan_step(*args):
            plan = original(*args)
            for segment in plan.segments:
                segment.peaks = segment.peaks if with_peaks else None
            planned.extend(segment.peaks is not None for segment in plan.segments)
            return plan

        original = optimizer_module.plan_step
        monkeypatch.setattr(optimizer_module, "plan_step", plan_step)
        torch.manual_seed(0)
        shapes = [(256, 128), (64, 64), (64, 64), (1024, 512), (256,)]
        params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
        opt = DisTrOAdamW(params, lr=0.01)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        monkeypatch.undo()
        return [p.detach().clone() for p in params], [opt.state[p]["delta"].clone() for p in params]

    params_a, deltas_a = run(True)
    assert any(planned)  # the peaks were planned, so the first run took them during the transform
    params_b, deltas_b = run(False)
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert all(torch.equal(a, b) for a, b in zip(deltas_a, deltas_b))
