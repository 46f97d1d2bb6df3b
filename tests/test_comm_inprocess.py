"""In-process workers: collectives block like real ones, count bytes by the documented rules."""
import importlib
import time

import pytest
import torch

from distro_opt import DisTrOAdamW
from distro_opt.comm import CommStats, InProcessBackend, InProcessGroupError, SingleWorkerBackend, resolve_backend


def test_all_gather_returns_every_buffer_in_rank_order_and_counts_bytes():
    def worker(backend):
        buf = torch.full((10 + backend.rank,), backend.rank, dtype=torch.uint8)
        return [b.tolist() for b in backend.all_gather(buf)], backend.stats

    results = InProcessBackend.run(3, worker, timeout_s=10)
    for rank, (bufs, stats) in enumerate(results):
        assert bufs == [[r] * (10 + r) for r in range(3)]
        assert stats.bytes_sent == 2 * (10 + rank)
        assert stats.bytes_received == sum(10 + r for r in range(3) if r != rank)
        assert stats.steps == 1


def test_all_reduce_mean_is_identical_everywhere_and_counts_ring_bytes():
    def worker(backend):
        t = torch.full((100,), float(backend.rank + 1))
        backend.all_reduce(t, op="mean")
        return t, backend.stats

    results = InProcessBackend.run(4, worker, timeout_s=10)
    for t, stats in results:
        assert torch.equal(t, torch.full((100,), 2.5))
        assert stats.bytes_sent == stats.bytes_received == 2 * 3 * 400 // 4


def test_byte_conventions_reproduce_the_distro_report_baseline():
    bf16_grad = 1_200_000_000 * 2
    assert CommStats.naive_all_reduce_bytes(bf16_grad, 32) == 74_400_000_000
    assert CommStats.ring_all_reduce_bytes(bf16_grad, 32) == 4_650_000_000


def test_collective_times_out_when_a_worker_never_arrives():
    backend = InProcessBackend.create(2, timeout_s=0.3)[0]
    start = time.monotonic()
    with pytest.raises(InProcessGroupError, match=r"timed out .* ranks \[1\]"):
        backend.all_gather(torch.zeros(4, dtype=torch.uint8))
    assert time.monotonic() - start < 5


def test_a_failing_worker_makes_the_others_fail_fast():
    def worker(backend):
        if backend.rank == 1:
            raise RuntimeError("boom")
        backend.all_gather(torch.zeros(4, dtype=torch.uint8))

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"):
        InProcessBackend.run(3, worker, timeout_s=60)
    assert time.monotonic() - start < 10


def test_all_gather_rejects_non_byte_buffers():
    with pytest.raises(TypeError, match="1-D torch.uint8"):
        SingleWorkerBackend().all_gather(torch.zeros(3))


def test_comm_none_without_torch_distributed_is_a_single_worker():
    opt = DisTrOAdamW([torch.nn.Parameter(torch.zeros(3))])
    assert isinstance(opt.comm, SingleWorkerBackend) and opt.comm.world_size == 1


def test_invalid_comm_is_rejected_by_name():
    with pytest.raises(TypeError, match="Invalid comm: str"):
        resolve_backend("nccl")


def test_jupyter_comm_and_distro_opt_comm_coexist():
    jupyter_comm = importlib.import_module("comm")
    ours = importlib.import_module("distro_opt.comm")
    assert hasattr(jupyter_comm, "create_comm")  # Jupyter's package, not ours
    assert ours.InProcessBackend is InProcessBackend
    assert jupyter_comm is not ours
