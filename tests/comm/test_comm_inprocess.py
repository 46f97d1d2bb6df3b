"""In-process workers: collectives block like real ones, count bytes by the documented rules."""
import gc
import importlib
import json
import subprocess
import sys
import threading
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


def test_all_gather_gives_each_worker_its_own_copy_of_every_buffer():
    turns = threading.Barrier(3, timeout=10)

    def worker(backend):
        bufs = backend.all_gather(torch.full((4,), backend.rank + 1, dtype=torch.uint8))
        turns.wait()
        if backend.rank == 0:
            for b in bufs:
                b.zero_()  # decoding in place must not reach the other workers' results
        turns.wait()
        return [b.tolist() for b in bufs]

    results = InProcessBackend.run(3, worker, timeout_s=10)
    assert results[1] == results[2] == [[1] * 4, [2] * 4, [3] * 4]


def test_single_worker_all_gather_returns_a_copy_of_the_buffer():
    buf = torch.full((4,), 5, dtype=torch.uint8)
    (received,) = SingleWorkerBackend().all_gather(buf)
    buf.zero_()  # the caller reuses its send buffer
    assert received.tolist() == [5, 5, 5, 5]


def outcomes(world_size, fn, timeout_s=10):
    """Run ``fn(backend)`` on every worker; return what it returned or the ValueError it raised."""

    def worker(backend):
        try:
            return fn(backend)
        except ValueError as exc:
            return exc

    return InProcessBackend.run(world_size, worker, timeout_s=timeout_s)


@pytest.mark.parametrize(
    "tensors,described",
    [
        ([torch.ones(3), torch.ones(1)], ["float32 tensor of shape (3,)", "float32 tensor of shape (1,)"]),
        ([torch.ones(2), torch.ones(2, dtype=torch.int64)], ["float32", "int64"]),
    ],
    ids=["shape", "dtype"],
)
def test_all_reduce_of_different_tensors_raises_the_same_error_on_every_worker(tensors, described):
    inputs = [t.clone() for t in tensors]
    start = time.monotonic()
    results = outcomes(2, lambda backend: backend.all_reduce(inputs[backend.rank], op="sum"))
    assert time.monotonic() - start < 5  # nobody waited for the timeout
    assert all(isinstance(r, ValueError) for r in results), results
    assert str(results[0]) == str(results[1])
    assert f"rank 0: all_reduce(op='sum') of a torch.{described[0]}" in str(results[0])
    assert f"rank 1: all_reduce(op='sum') of a torch.{described[1]}" in str(results[0])
    assert all(torch.equal(i, t) for i, t in zip(inputs, tensors))  # left as they were


def test_all_gather_meeting_an_all_reduce_raises_the_same_error_on_every_worker():
    def worker(backend):
        if backend.rank == 0:
            return backend.all_gather(torch.full((2,), 7, dtype=torch.uint8))
        return backend.all_reduce(torch.ones(2), op="sum")

    results = outcomes(2, worker)
    assert all(isinstance(r, ValueError) for r in results), results
    assert str(results[0]) == str(results[1])
    assert "collective #1" in str(results[0])
    assert "rank 0: all_gather, rank 1: all_reduce(op='sum')" in str(results[0])


@pytest.mark.parametrize("make", [SingleWorkerBackend, lambda: InProcessBackend.create(1)[0]],
                         ids=["single", "in-process"])
def test_all_reduce_mean_of_an_integer_tensor_is_refused_before_anything_is_sent(make):
    backend = make()
    t = torch.tensor([3, 10])
    with pytest.raises(ValueError, match=r"op='mean' of a torch.int64 tensor.*op='sum'"):
        backend.all_reduce(t, op="mean")
    assert t.tolist() == [3, 10]
    assert backend.stats.steps == 0


def test_timeout_message_shows_sub_second_timeouts():
    backend = InProcessBackend.create(2, timeout_s=0.3)[0]
    with pytest.raises(InProcessGroupError, match=r"timed out after 0\.3 s"):
        backend.all_reduce(torch.zeros(1))


_INTERRUPT_SCRIPT = r"""
import _thread, json, signal, sys, time
import torch
from distro_opt.comm import InProcessBackend, InProcessGroupError

JOB_S = float(sys.argv[1])
ended = {}
# a shell that starts a command in the background makes it ignore SIGINT, and interrupt_main() then
# does nothing: give this process Python's own Ctrl-C handler, as a terminal's foreground job has
signal.signal(signal.SIGINT, signal.default_int_handler)

def worker(backend):  # a JOB_S job; rank 1 sends the Ctrl-C, then blocks in the collective
    try:
        for i in range(40):
            if backend.rank == 0:
                time.sleep(JOB_S / 40)
            elif i == 0:
                _thread.interrupt_main()  # run() is waiting on the jobs by now
            backend.all_reduce(torch.zeros(1))
    except InProcessGroupError as exc:
        ended[backend.rank] = [time.monotonic() - start, str(exc)]

start = time.monotonic()
try:
    InProcessBackend.run(2, worker, timeout_s=30)
    raised = None
except KeyboardInterrupt:
    raised = time.monotonic() - start
deadline = time.monotonic() + JOB_S
while len(ended) < 2 and time.monotonic() < deadline:  # rank 0 stops at its next collective
    time.sleep(0.01)
print(json.dumps({"raised_after_s": raised, "ended": ended}))
"""


def test_an_interrupt_in_the_caller_aborts_the_group_without_waiting_for_the_jobs():
    # In a process of its own, so that setting the SIGINT handler changes nothing in this one.
    job_s = 10.0
    out = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_SCRIPT, str(job_s)], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["raised_after_s"] is not None and result["raised_after_s"] < job_s / 2, result
    assert sorted(result["ended"]) == ["0", "1"], result
    assert all(t < job_s / 2 and "interrupted by KeyboardInterrupt" in m for t, m in result["ended"].values())


def live_tensors(numel):
    """How many tensors of ``numel`` elements are alive anywhere in this process."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.numel() == numel)


def test_all_gathers_never_waited_on_free_their_buffers():
    def worker(backend):
        for _ in range(50):
            backend.start_all_gather(torch.zeros(12_347, dtype=torch.uint8))  # abandoned at once

    group = InProcessBackend.create(2, timeout_s=10)  # still in use, as by an optimizer that goes on
    InProcessBackend.run(2, worker, backends=group)
    assert live_tensors(12_347) == 0


def test_a_round_given_up_after_a_timeout_is_freed_once_the_late_worker_completes_it():
    early, late = InProcessBackend.create(2, timeout_s=0.2)
    with pytest.raises(InProcessGroupError, match="timed out"):
        early.all_gather(torch.full((12_349,), 1, dtype=torch.uint8))
    bufs = late.all_gather(torch.full((12_349,), 2, dtype=torch.uint8))
    assert [int(b[0]) for b in bufs] == [1, 2]  # the round still completes for the late worker
    del bufs
    assert live_tensors(12_349) == 0


def test_all_gathers_in_flight_together_can_be_waited_on_in_any_order():
    def worker(backend):
        first, second = (backend.start_all_gather(torch.full((2,), n, dtype=torch.uint8)) for n in (1, 2))
        return [b.tolist() for b in second.wait()], [b.tolist() for b in first.wait()]

    for second, first in InProcessBackend.run(2, worker, timeout_s=10):
        assert (first, second) == ([[1, 1]] * 2, [[2, 2]] * 2)
