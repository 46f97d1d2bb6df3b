"""Several workers: identical replicas and counted bytes, a worker with non-finite values or another
model, and steps rejected for a bad payload that change nothing."""
import math
import warnings

import pytest
import torch

from distro_opt import DeMo, DisTrOAdamW, PayloadError
from distro_opt.comm import InProcessBackend, SingleWorkerBackend
from distro_opt.guards import CHECKSUM_NBYTES

from _models import OPTIMIZERS, batch, make_model, train


def _replicas(world_size, fn, steps=6):
    models = [make_model() for _ in range(world_size)]  # built here: torch's global RNG is not per thread

    def worker(backend):
        model = models[backend.rank]
        opt = fn(model, backend)
        train(model, opt, steps, rank=backend.rank)
        return [p.detach().clone() for p in model.parameters()], backend.stats

    return InProcessBackend.run(world_size, worker, timeout_s=60)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_workers_end_with_identical_replicas_and_counted_bytes(cls):
    results = _replicas(4, lambda m, b: cls(m.parameters(), lr=0.01, comm=b))
    first = results[0][0]
    for params, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, params))
    nbytes = cls(make_model().parameters()).payload_nbytes
    for _, stats in results:
        assert stats.steps == 6 + 1  # six payloads and the replica check of the first step
        assert stats.bytes_sent == stats.bytes_received == 6 * 3 * nbytes + 3 * CHECKSUM_NBYTES


def test_payload_nbytes_is_known_before_a_step_and_is_what_is_sent():
    model = make_model()
    backends = InProcessBackend.create(1)
    opt = DisTrOAdamW(model.parameters(), comm=backends[0])
    expected = opt.payload_nbytes
    sent = []
    original = backends[0].start_all_gather
    backends[0].start_all_gather = lambda buf: sent.append(buf.numel()) or original(buf)
    train(model, opt, 2)
    assert sent == [expected, expected]


# value codecs of each kind (the scaled ones map each value to an integer code), NaN and inf
@pytest.mark.parametrize("bits, bad", [(1, "nan"), (1, "inf"), (8, "nan"), (8, "-inf"), (2, "nan"),
                                       (32, "inf")])
def test_non_finite_worker_contributes_nothing_and_poisons_no_one(bits, bad):
    models = [make_model() for _ in range(3)]

    def worker(backend):
        model = models[backend.rank]
        opt = DisTrOAdamW(model.parameters(), lr=0.01, comm=backend, compression_bits=bits)
        for t in range(4):
            x, y = batch(t, backend.rank)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if backend.rank == 1 and t == 2:
                next(model.parameters()).grad[0, 0] = float(bad)
            opt.step()
        return [p.detach().clone() for p in model.parameters()], float(opt.state[model[0].weight]["delta"].abs().sum())

    # warnings state is process-wide: record it around all worker threads, not inside one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = InProcessBackend.run(3, worker, timeout_s=60)
    assert sum("non-finite local gradient" in str(w.message) for w in caught) == 1
    for params, delta_sum in results:
        assert math.isfinite(delta_sum)
        assert all(torch.isfinite(p).all() for p in params)
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], params))


@pytest.mark.parametrize("bits", [32, 16, 8])  # float32 values, bf16 values, a bf16 chunk scale
def test_a_finite_momentum_beyond_the_codecs_range_is_not_sent_as_inf(bits):
    """float64 momentum of 1e39 is finite, but float32 and bf16 carry at most ~3.4e38: the worker
    contributes nothing (instead of sending inf, which every receiver would refuse)."""
    params = [torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.float64)) for _ in range(2)]

    def worker(backend):
        p = params[backend.rank]
        opt = DeMo([p], lr=0.1, compression_bits=bits, comm=backend)
        p.grad = torch.full_like(p, 1e39 if backend.rank == 1 else 1.0)
        opt.step()
        return p.detach().clone()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = InProcessBackend.run(2, worker, timeout_s=60)
    assert sum("non-finite local gradient" in str(w.message) for w in caught) == 1
    for p in results:  # the healthy worker's sign step alone: -lr where its gradient was
        assert torch.isfinite(p).all() and torch.equal(p, results[0])
    assert (results[0] != 0).any()


@pytest.mark.parametrize("width", [32, 33])  # same buffer size but other shapes; other size
def test_mismatched_models_raise_on_every_worker(width):
    models = [make_model(width=32), make_model(width=width)]

    def worker(backend):
        model = models[backend.rank]
        if backend.rank == 1 and width == 32:  # same shapes, other order
            model = torch.nn.Sequential(*reversed([m for m in model]))
        opt = DisTrOAdamW(model.parameters(), comm=backend)
        params = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        try:
            opt.step()
        except ValueError as exc:
            unchanged = all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
            return str(exc), unchanged, len(opt.state)
        return None, None, None

    results = InProcessBackend.run(2, worker, timeout_s=60)
    assert results[0][0] == results[1][0].replace("seen by rank 1", "seen by rank 0")  # the same error
    for message, unchanged, nstate in results:
        assert message is not None and "the workers hold different parameters" in message
        assert unchanged and nstate == 0  # refused before any state or parameter changed


def test_mismatched_settings_raise_a_layout_mismatch_on_every_worker():
    models = [make_model(), make_model()]  # the same parameters: the replica check passes

    def worker(backend):  # another top-k on worker 1
        model = models[backend.rank]
        opt = DisTrOAdamW(model.parameters(), comm=backend, compression_topk=4 + backend.rank)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        with pytest.raises(PayloadError, match="layout mismatch"):
            opt.step()
        return opt.replica_check_stats.steps

    assert InProcessBackend.run(2, worker, timeout_s=60) == [1, 1]


class _CorruptingBackend(SingleWorkerBackend):
    """One worker whose gather hands back a truncated second payload on the steps in ``bad_steps``."""

    def __init__(self, bad_steps):
        super().__init__()
        self.bad_steps, self.calls = set(bad_steps), 0

    def all_gather(self, buf):
        self.calls += 1
        out = super().all_gather(buf)
        return out + [buf[:-1]] if self.calls in self.bad_steps else out + [buf]


def _step_is_rejected_and_changes_nothing(model, opt, t):
    """One step on batch ``t`` that must raise for worker 1's payload and leave the parameters and
    the momentum as they were; returns the model's state from before it."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    deltas = [opt.state[p]["delta"].clone() for p in model.parameters()]
    x, y = batch(t)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(PayloadError, match="worker 1"):
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(d, opt.state[p]["delta"]) for d, p in zip(deltas, model.parameters()))
    return before


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_rejected_step_leaves_state_as_committed_and_training_continues_unharmed(cls):
    """The momentum is written into a spare buffer and committed only after every payload is
    validated: a rejected step changes nothing, and the run goes on as if it never happened."""
    runs = {}
    for name, bad in (("clean", ()), ("faulty", (3,))):
        model = make_model()
        opt = cls(model.parameters(), lr=0.01, comm=_CorruptingBackend(bad))
        train(model, opt, 2)
        if bad:
            _step_is_rejected_and_changes_nothing(model, opt, 99)
        train(model, opt, 3, start=2)
        runs[name] = [p.detach().clone() for p in model.parameters()] + [opt.state[p]["delta"] for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(runs["clean"], runs["faulty"]))


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_overlap_mode_rejected_step_changes_nothing_and_training_goes_on(cls):
    """In overlap mode step t validates step t-1's payloads before it commits its own momentum and
    sends it: a step that rejects them changes neither parameters nor state (step t-1's update is
    lost, on every worker alike), and the next step trains on."""
    model = make_model()
    opt = cls(model.parameters(), lr=0.01, comm=_CorruptingBackend({3}), overlap=True)
    train(model, opt, 3)  # step 3's gather (the bad one) is finished by step 4
    before = _step_is_rejected_and_changes_nothing(model, opt, 3)
    train(model, opt, 2, start=4)
    opt.flush()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


class _TwoWorkerBackend(SingleWorkerBackend):
    """One worker whose gather hands back, after its own payload, ``other`` as a second worker's."""

    other = None

    def all_gather(self, buf):
        return super().all_gather(buf) + [self.other]


@pytest.mark.parametrize("value, refused", [(1e30, False), (1e300, True)])
def test_float64_values_beyond_float32_are_refused_before_a_float32_momentum_takes_them(value, refused):
    """With compression_bits=64 on float32 parameters the wire carries float64 values, which are
    applied in float32: one beyond its range would land as inf, so the payload is refused."""
    p = torch.nn.Parameter(torch.zeros(16, 16))
    backend = _TwoWorkerBackend()
    opt = DisTrOAdamW([p], lr=0.01, compression_bits=64, compression_chunk=16, comm=backend)
    seg = opt.payload_layout.segments[0]
    values = torch.full((seg.num_chunks, seg.k), value, dtype=torch.float64)
    backend.other = opt.payload_layout.pack([(torch.arange(seg.k).expand(seg.num_chunks, -1),
                                                values.view(torch.uint8).reshape(-1))])
    p.grad = torch.ones_like(p)
    if not refused:
        opt.step()
        assert torch.isfinite(p).all() and (p != 0).any()
        return
    with pytest.raises(PayloadError, match="worker 1 rejected: .* beyond the range of torch.float32"):
        opt.step()
    assert not p.any() and not opt.state[p]["delta"].any()
