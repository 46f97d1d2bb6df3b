"""The trimmed-mean aggregate for untrusted contributors (distro_opt/robust.py): what it equals when
everyone agrees, what it drops, and that one rogue no longer steers DisTrO-AdamW's sign update."""

from types import SimpleNamespace

import pytest
import torch

from distro_opt import DisTrOAdamW
from distro_opt.comm import InProcessBackend
from distro_opt.robust import trim_count, trimmed_mean_aggregate
from distro_opt.step import aggregate, to_device

from _models import batch, make_model

SEG = SimpleNamespace(num_chunks=3, chunk_numel=16)
LIKE = torch.zeros(1)


def dense(idx, weights):
    return torch.zeros(SEG.num_chunks, SEG.chunk_numel).scatter_add_(1, idx, weights)


def robust(contributions, fraction=0.25):
    return dense(*trimmed_mean_aggregate(SEG, contributions, LIKE, fraction, to_device))


def contribution(seed, k=4):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(SEG.chunk_numel, generator=g)[:k] for _ in range(SEG.num_chunks)])
    return idx, torch.randn(SEG.num_chunks, k, generator=g)


@pytest.mark.parametrize("n, fraction, b", [(2, 0.25, 0), (3, 0.25, 1), (4, 0.25, 1), (8, 0.25, 2), (8, 0.45, 3)])
def test_trim_count_keeps_a_middle_value(n, fraction, b):
    assert trim_count(n, fraction) == b


def test_trimmed_mean_equals_demos_aggregate_when_all_contributors_send_the_same_payload():
    same = [contribution(1)] * 5
    assert torch.allclose(robust(same), dense(*aggregate(SEG, same, LIKE)), rtol=1e-6, atol=0)


def test_a_coefficient_only_the_rogue_keeps_counts_for_nothing():
    honest = [contribution(s) for s in range(3)]
    rogue_idx = torch.full((SEG.num_chunks, 1), 15)
    honest = [(i.clamp(max=14), v) for i, v in honest]  # nobody honest keeps coefficient 15
    rogue = (rogue_idx, torch.full((SEG.num_chunks, 1), 3e38))
    assert dense(*aggregate(SEG, [*honest, rogue], LIKE))[:, 15].eq(3e38).all()  # DeMo: undiluted
    assert robust([*honest, rogue])[:, 15].eq(0).all()


def test_each_coefficient_stays_within_the_honest_values_whatever_one_rogue_sends():
    honest = [contribution(s) for s in range(4)]
    lo = torch.stack([dense(i, v) for i, v in honest]).min(0).values
    hi = torch.stack([dense(i, v) for i, v in honest]).max(0).values
    for rogue_value in (3e38, -3e38):
        rogue = (torch.arange(SEG.chunk_numel).repeat(SEG.num_chunks, 1), torch.full((3, 16), rogue_value))
        agg = robust([*honest, rogue])
        assert (agg >= lo).all() and (agg <= hi).all()


def share_moved_the_rogues_way(untrusted_fraction: float, steps: int = 3) -> float:
    """4 workers, rank 0 sending 1e30 * ones as its gradient (valid 8-bit payloads whose energy sits
    on the DC coefficients): the share of an honest worker's update entries that went down."""
    torch.manual_seed(0)
    start = make_model().state_dict()

    def worker(backend):
        backend.untrusted_fraction = untrusted_fraction
        model = make_model()
        model.load_state_dict(start)
        opt = DisTrOAdamW(model.parameters(), lr=1e-2, compression_topk=8, compression_chunk=64, compression_bits=8,
                          update="sign", comm=backend)  # the volunteer program's rule
        down = 0.0
        for t in range(steps):
            x, y = batch(t, backend.rank)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if backend.rank == 0:
                for p in model.parameters():
                    p.grad = torch.full_like(p.grad, 1e30)
            before = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
            opt.step()
            after = torch.nn.utils.parameters_to_vector(model.parameters())
            down += (after < before).float().mean().item() / steps
        return down

    return InProcessBackend.run(4, worker)[-1]


def test_one_rogue_of_four_steers_demos_aggregate_but_not_the_trimmed_mean():
    assert share_moved_the_rogues_way(0.0) > 0.95
    assert share_moved_the_rogues_way(0.25) < 0.65
