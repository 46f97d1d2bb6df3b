"""Torch conventions and multi-worker behaviour of DisTrOAdamW and DeMo."""
import copy
import io
import math
import warnings

import pytest
import torch

from distro_opt import DeMo, DisTrOAdamW, PayloadError
from distro_opt.comm import InProcessBackend, SingleWorkerBackend

OPTIMIZERS = [DisTrOAdamW, DeMo]


def make_model(seed=0, width=32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))


def batch(step, rank=0):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(model, opt, steps, rank=0, start=0):
    for t in range(start, start + steps):
        x, y = batch(t, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1.0), "Invalid learning rate: -1.0"),
        (dict(lr=float("nan")), "Invalid learning rate: nan"),
        (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
        (dict(compression_decay=1.0), "Invalid compression_decay value: 1.0"),
        (dict(compression_topk=0), "Invalid compression_topk value: 0"),
        (dict(compression_chunk=2.5), "Invalid compression_chunk value: 2.5"),
        (dict(compression_bits=3), "Invalid compression_bits: 3"),
    ],
)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_invalid_hyperparameters_raise_torch_style(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(make_model().parameters(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0"), (dict(eps=-1e-8), "Invalid epsilon value"),
     (dict(update="lion"), "Invalid update")],
)
def test_distro_adamw_validates_adam_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DisTrOAdamW(make_model().parameters(), **kwargs)


def test_distro_adamw_accepts_adamw_positional_signature():
    opt = DisTrOAdamW(make_model().parameters(), 3e-4, (0.8, 0.95), 1e-6, 0.1, False)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.1)


def test_distro_adamw_takes_every_keyword_of_torchs_adamw():
    import inspect

    ours = inspect.signature(DisTrOAdamW).parameters
    for name, param in inspect.signature(torch.optim.AdamW).parameters.items():
        assert name in ours and ours[name].default == param.default, name
    DisTrOAdamW(make_model().parameters(), foreach=True, fused=False, update="adam", amsgrad=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(capturable=True), "capturable=True is not supported"),
    (dict(differentiable=True), "differentiable=True is not supported"),
    (dict(amsgrad=True), "amsgrad=True applies to update='adam'"),
])
def test_adamw_flags_this_optimizer_cannot_honour_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DisTrOAdamW(make_model().parameters(), **kwargs)


def test_maximize_ascends_where_the_default_descends():
    runs = {}
    for maximize in (False, True):
        model = make_model()
        opt = DisTrOAdamW(model.parameters(), lr=0.01, weight_decay=0.0, maximize=maximize)
        x, y = batch(0)
        losses = []
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        runs[maximize] = losses
    assert runs[False][-1] < runs[False][0] and runs[True][-1] > runs[True][0]


def test_a_checkpoint_saved_before_the_adamw_flags_existed_loads_with_their_defaults():
    model = make_model()
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    train(model, opt, 1)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        for key in ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused"):
            del group[key]
    fresh = DisTrOAdamW(model.parameters(), lr=0.01)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["maximize"] is False and fresh.param_groups[0]["fused"] is None
    train(model, fresh, 1)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_closure_is_called_with_grad_enabled_and_its_loss_returned(cls):
    model = make_model()
    opt = cls(model.parameters())
    x, y = batch(0)

    def closure():
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    assert isinstance(opt.step(closure), torch.Tensor)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_lr_scheduler_sets_the_sign_step_size(cls):
    model = make_model()
    opt = cls(model.parameters(), lr=0.01, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 1)
    sched.step()
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 1, start=1)
    biggest = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))
    assert biggest == pytest.approx(0.005, rel=1e-5)


def test_param_groups_have_their_own_settings():
    model = make_model()
    opt = DisTrOAdamW(
        [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters(), "compression_topk": 16}],
        lr=0.01,
    )
    frozen = [p.detach().clone() for p in model[0].parameters()]
    moved = [p.detach().clone() for p in model[2].parameters()]
    small = DisTrOAdamW(model.parameters()).payload_nbytes
    assert opt.payload_nbytes > small  # topk 16 instead of 4 for the second layer
    train(model, opt, 2)
    assert all(torch.equal(p, f) for p, f in zip(model[0].parameters(), frozen))
    assert not any(torch.equal(p, m) for p, m in zip(model[2].parameters(), moved))


@pytest.mark.parametrize("cls, extra", [(DeMo, {}), (DisTrOAdamW, {"update": "sign"}), (DisTrOAdamW, {"update": "adam"})])
def test_state_dict_resume_is_bit_identical(cls, extra):
    straight = make_model()
    opt = cls(straight.parameters(), lr=0.01, **extra)
    train(straight, opt, 10)

    first = make_model()
    opt = cls(first.parameters(), lr=0.01, **extra)
    train(first, opt, 5)
    saved = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, saved)
    saved.seek(0)
    ckpt = torch.load(saved)
    resumed = make_model(seed=123)
    resumed.load_state_dict(ckpt["model"])
    opt = cls(resumed.parameters(), lr=0.01, **extra)
    opt.load_state_dict(ckpt["opt"])
    train(resumed, opt, 5, start=5)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_copying_or_pickling_the_optimizer_object_says_to_use_state_dict(cls):
    """torch's own pickling of an optimizer keeps only defaults, state and param_groups, which would
    give an object that fails at its first step: refused up front, with the supported way named."""
    model = make_model()
    opt = cls(model.parameters(), lr=0.01)
    train(model, opt, 2)
    with pytest.raises(TypeError, match=r"cannot be deep-copied or pickled whole.*state_dict\(\)"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="load_state_dict"):
        torch.save(opt, io.BytesIO())
    train(model, opt, 1, start=2)  # the refusal changed nothing


def test_state_dict_holds_every_tensor_of_state():
    model = make_model()
    opt = DisTrOAdamW(model.parameters(), update="adam")
    train(model, opt, 1)
    state = opt.state_dict()["state"][0]
    assert set(state) == {"step", "delta", "exp_avg", "exp_avg_sq"}
    assert state["delta"].abs().sum() > 0  # error feedback kept what was not sent


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
        assert stats.steps == 6
        assert stats.bytes_sent == stats.bytes_received == 6 * 3 * nbytes


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


@pytest.mark.parametrize("steps_before", [1, 2])
def test_unfreezing_a_parameter_leaves_the_others_momentum_intact(steps_before):
    """A frozen matrix unfrozen after some steps changes the payload's segments: the new segment
    must not write into a buffer that still holds another parameter's momentum. Reference: the
    same run through a checkpoint just before the unfreezing, which starts from fresh buffers."""

    def run(through_checkpoint):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
        v = torch.nn.Parameter(torch.randn(4096))  # as many elements as w: same-sized buffers
        opt = DisTrOAdamW([w, v], lr=0.01)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps_before):
            v.grad = torch.randn(4096, generator=g)
            opt.step()
        if through_checkpoint:
            state = opt.state_dict()
            opt = DisTrOAdamW([w, v], lr=0.01)
            opt.load_state_dict(state)
        w.requires_grad_(True)
        w.grad, v.grad = torch.randn(64, 64, generator=g) * 100, torch.randn(4096, generator=g)
        opt.step()
        return [t.detach().clone() for t in (w, v, opt.state[w]["delta"], opt.state[v]["delta"])]

    for ours, reference in zip(run(False), run(True)):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("width", [32, 33])  # same buffer size but other shapes; other size
def test_mismatched_models_raise_on_every_worker(width):
    models = [make_model(width=32), make_model(width=width)]

    def worker(backend):
        model = models[backend.rank]
        if backend.rank == 1 and width == 32:  # same shapes, other order: the fingerprint differs
            model = torch.nn.Sequential(*reversed([m for m in model]))
        opt = DisTrOAdamW(model.parameters(), comm=backend)
        params = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        try:
            opt.step()
        except PayloadError as exc:
            unchanged = all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
            return str(exc), unchanged, len(opt.state)
        return None, None, None

    for message, unchanged, nstate in InProcessBackend.run(2, worker, timeout_s=60):
        assert message is not None and "layout mismatch" in message
        assert unchanged and nstate <= 4  # nothing written into parameters before validation


def test_bf16_model_keeps_float32_buffers_across_resume():
    model = make_model().to(torch.bfloat16)
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    x, y = batch(0)
    torch.nn.functional.cross_entropy(model(x.bfloat16()), y).backward()
    opt.step()
    saved = opt.state_dict()
    fresh = DisTrOAdamW(model.parameters(), lr=0.01)
    fresh.load_state_dict(saved)
    for p in model.parameters():
        assert fresh.state[p]["delta"].dtype == torch.float32
        assert torch.equal(fresh.state[p]["delta"], opt.state[p]["delta"])


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
def test_a_parameter_with_no_elements_is_accepted_and_left_alone(cls):
    empty, w = torch.nn.Parameter(torch.zeros(0, 8)), torch.nn.Parameter(torch.ones(8, 8))
    opt = cls([empty, w], lr=0.1)
    assert opt.payload_nbytes == cls([w], lr=0.1).payload_nbytes
    empty.grad, w.grad = torch.zeros(0, 8), torch.ones(8, 8)
    opt.step()
    assert empty.shape == (0, 8) and (w != 1).all()


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
    backend.other = opt.payload_layout.encode([(torch.arange(seg.k).expand(seg.num_chunks, -1),
                                                values.view(torch.uint8).reshape(-1))])
    p.grad = torch.ones_like(p)
    if not refused:
        opt.step()
        assert torch.isfinite(p).all() and (p != 0).any()
        return
    with pytest.raises(PayloadError, match="worker 1 rejected: .* beyond the range of torch.float32"):
        opt.step()
    assert not p.any() and not opt.state[p]["delta"].any()


def test_segment_mixing_float64_and_float32_parameters_keeps_each_buffer_dtype():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).double())
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    for p in model.parameters():
        assert opt.state[p]["delta"].dtype == p.dtype
        assert torch.isfinite(p).all()


def _state_tensors(opt):
    """Every tensor of the optimizer's state, the local-step mode's inner optimizer's included."""
    states = list(opt.state.values())
    if getattr(opt, "inner_optimizer", None) is not None:
        states += list(opt.inner_optimizer.state.values())
    return [t for st in states if isinstance(st, dict) for t in st.values() if torch.is_tensor(t)]


@pytest.mark.parametrize("make", [
    lambda ps: DisTrOAdamW(ps, lr=0.01),
    lambda ps: DisTrOAdamW(ps, lr=0.01, update="adam"),
    lambda ps: DisTrOAdamW(ps, lr=0.01, update="rms"),
    lambda ps: DisTrOAdamW(ps, lr=0.01, sync_every=2, outer_momentum=0.5),
    lambda ps: DisTrOAdamW(ps, lr=0.01, overlap=True),
    lambda ps: DeMo(ps, lr=0.01),
], ids=["sign", "adam", "rms", "local-steps", "overlap", "demo"])
@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "float32+float64"])
def test_state_is_ordinary_tensors_that_users_can_update_in_place(make, mixed):
    """The step runs under inference mode; what it keeps must not be inference tensors, which
    torch refuses to update in place outside it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    if mixed:
        model[1].double()
    opt = make(model.parameters())
    for _ in range(4):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    tensors = _state_tensors(opt)
    assert tensors and not [t.shape for t in tensors if t.is_inference()]
    for t in tensors:
        t.mul_(1.0)  # raises for an inference tensor
    fresh = make(model.parameters())
    fresh.load_state_dict(opt.state_dict())
    for o in (opt, fresh):
        o.step()
        assert not [t.shape for t in _state_tensors(o) if t.is_inference()]
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("group, message", [
    (dict(update="momentum"), "Invalid update: 'momentum'"),
    (dict(compression_topk=0), "Invalid compression_topk value: 0"),
    (dict(lr=-0.5), "Invalid learning rate: -0.5"),
    (dict(betas=(1.5, 0.9)), "Invalid beta parameter at index 0: 1.5"),
    (dict(betas=(0.9, float("nan"))), "Invalid beta parameter at index 1: nan"),
    (dict(eps=-1.0), "Invalid epsilon value: -1.0"),
    (dict(eps=float("nan")), "Invalid epsilon value: nan"),
    (dict(outer_lr=-1.0), "Invalid outer_lr value: -1.0"),
    (dict(outer_momentum=1.5), "Invalid outer_momentum value: 1.5"),
    (dict(outer_momentum=float("nan")), "Invalid outer_momentum value: nan"),
])
def test_per_group_settings_are_validated_like_the_constructor(group, message):
    model = make_model()
    first, *rest = list(model.parameters())
    with pytest.raises(ValueError, match=message):
        DisTrOAdamW([{"params": [first]}, {"params": rest, **group}])


FLAG_SETS = [{}, {"amsgrad": True}, {"maximize": True}, {"amsgrad": True, "maximize": True}]


@pytest.mark.parametrize("flags", FLAG_SETS, ids=["plain", "amsgrad", "maximize", "both"])
def test_adam_update_without_compression_is_adamw_on_the_mean_gradient(flags):
    """Top-k of every coefficient at 64 bits sends the whole momentum, so the error feedback is
    empty and the aggregate is the workers' mean gradient: the Adam update must then be torch's
    AdamW fed that mean (float64, up to the DCT round trip's rounding), with its flags too."""
    world, steps = 3, 5
    grads = [[torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * r + t))
              for t in range(steps)] for r in range(world)]
    if flags.get("amsgrad"):  # a second moment that shrinks, where amsgrad's maximum differs
        grads = [[g * (4.0 if t < 2 else 0.1) for t, g in enumerate(gs)] for gs in grads]
    start = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(99))
    settings = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **flags)

    def worker(backend):
        p = torch.nn.Parameter(start.clone())
        opt = DisTrOAdamW([p], **settings, update="adam", compression_topk=16 * 16, compression_chunk=16,
                          compression_bits=64, comm=backend)
        for g in grads[backend.rank]:
            p.grad = g.clone()
            opt.step()
        return p.detach()

    results = InProcessBackend.run(world, worker, timeout_s=60)
    ref = torch.nn.Parameter(start.clone())
    adamw = torch.optim.AdamW([ref], **settings)
    for t in range(steps):
        ref.grad = sum(grads[r][t] for r in range(world)) / world
        adamw.step()
    for got in results:
        torch.testing.assert_close(got, ref.detach(), rtol=0, atol=1e-12)
    assert not torch.allclose(ref.detach(), start)  # it did move


def test_rms_update_is_the_aggregate_over_its_rms():
    """Nothing compressed, one worker, first step: the aggregate is the gradient itself, so the
    step must be p * (1 - lr * wd) - lr * g / rms(g)."""
    g = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    start = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    p = torch.nn.Parameter(start.clone())
    opt = DisTrOAdamW([p], lr=0.01, weight_decay=0.1, update="rms", compression_topk=256, compression_chunk=16,
                      compression_bits=64)
    p.grad = g.clone()
    opt.step()
    expected = start * (1 - 0.01 * 0.1) - 0.01 * g / g.pow(2).mean().sqrt()
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-12)


def test_rms_update_leaves_a_tensor_without_any_signal_where_it_was():
    p = torch.nn.Parameter(torch.ones(8, 8))
    opt = DisTrOAdamW([p], lr=0.01, weight_decay=0.0, update="rms")
    p.grad = torch.zeros(8, 8)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(8, 8))


def test_error_feedback_buffer_is_the_dct_of_the_gradient_minus_what_was_sent_in_the_parameters_shape():
    """One worker, 32-bit values, first step: Delta = DCT(g) with each chunk's k largest |.| sent and
    zeroed, in the parameter's own layout. Checked against scipy, chunk by chunk."""
    import numpy as np
    import scipy.fft

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(128, 192))
    p.grad = torch.randn(128, 192)
    opt = DisTrOAdamW([p], lr=0.01, compression_topk=4, compression_bits=32)
    opt.step()
    delta = opt.state[p]["delta"]
    assert delta.shape == p.shape
    g = p.grad.double().numpy()
    for bi in range(2):
        for bj in range(3):
            sl = (slice(64 * bi, 64 * bi + 64), slice(64 * bj, 64 * bj + 64))
            coeffs = scipy.fft.dctn(g[sl], norm="ortho")
            top = np.argsort(-np.abs(coeffs).reshape(-1))[:4]
            coeffs.reshape(-1)[top] = 0.0
            np.testing.assert_allclose(delta[sl].numpy(), coeffs, atol=1e-5)


# the old layout is read with the checkpoint's own chunk size, whatever the loading optimizer's is
@pytest.mark.parametrize("saved_chunk, loading_chunk", [(64, 64), (16, 64)])
def test_checkpoint_with_chunk_rows_from_an_older_version_loads_into_the_parameters_layout(
    saved_chunk, loading_chunk
):
    from distro_opt import DCTTransform

    model = make_model(width=128)
    opt = DisTrOAdamW(model.parameters(), lr=0.01, compression_chunk=saved_chunk)
    train(model, opt, 2)
    saved = opt.state_dict()
    assert saved["delta_layout"] == "tensor"
    shapes = [tuple(p.shape) for p in model.parameters()]
    chunks = [DCTTransform.chunk_shape(s, saved_chunk) for s in shapes]
    assert not all(DCTTransform.own_layout_is_chunk_major(s, c) for s, c in zip(shapes, chunks))
    old_format = {"state": {}, "param_groups": saved["param_groups"]}  # as distro-opt saved it before
    for (i, s), p in zip(saved["state"].items(), model.parameters()):
        chunk = DCTTransform.chunk_shape(tuple(p.shape), saved_chunk)
        old_format["state"][i] = dict(s, delta=DCTTransform.chunk_rows(s["delta"], chunk).clone())
    fresh = DisTrOAdamW(model.parameters(), lr=0.01, compression_chunk=loading_chunk)
    fresh.load_state_dict(old_format)
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["delta"], opt.state[p]["delta"])


def test_checkpoint_with_an_unknown_delta_layout_or_wrong_shape_is_refused():
    model = make_model()
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    train(model, opt, 1)
    saved = opt.state_dict()
    with pytest.raises(ValueError, match="unknown delta_layout"):
        DisTrOAdamW(model.parameters(), lr=0.01).load_state_dict(dict(saved, delta_layout="columns"))
    bad = {"state": {i: dict(s, delta=s["delta"].reshape(-1)[:-1]) for i, s in saved["state"].items()},
           "param_groups": saved["param_groups"], "delta_layout": "tensor"}
    target = DisTrOAdamW(model.parameters(), lr=0.01)
    train(model, target, 1)
    before = {p: target.state[p]["delta"].clone() for p in model.parameters()}
    with pytest.raises(ValueError, match="delta for parameter 0 has shape"):
        target.load_state_dict(bad)
    assert all(torch.equal(target.state[p]["delta"], d) for p, d in before.items())  # nothing changed


def test_an_old_checkpoint_whose_rows_have_the_parameters_shape_is_still_read_as_rows():
    """A (128, 4096) matrix of 64x64 chunks has 128 chunk rows of 4096: its shape either way. A
    checkpoint without a delta_layout entry is then read as rows, as before that entry existed."""
    from distro_opt import DCTTransform

    p = torch.nn.Parameter(torch.randn(128, 4096, generator=torch.Generator().manual_seed(0)))
    opt = DisTrOAdamW([p], lr=0.01)
    for _ in range(2):
        p.grad = torch.randn(128, 4096, generator=torch.Generator().manual_seed(1))
        opt.step()
    saved = opt.state_dict()
    rows = DCTTransform.chunk_rows(saved["state"][0]["delta"], (64, 64)).clone()
    assert rows.shape == p.shape and not torch.equal(rows, saved["state"][0]["delta"])
    fresh = DisTrOAdamW([p], lr=0.01)
    old_format = {"state": {0: dict(saved["state"][0], delta=rows)}, "param_groups": saved["param_groups"]}
    fresh.load_state_dict(old_format)
    assert torch.equal(fresh.state[p]["delta"], opt.state[p]["delta"])


def test_a_refused_load_keeps_the_overlap_update_in_flight():
    """torch refuses a checkpoint of another number of groups only inside its load_state_dict: the
    update still travelling must survive that, as if the load had not been tried."""
    runs = []
    for refused in (False, True):
        model = make_model()
        opt = DisTrOAdamW(model.parameters(), lr=0.01, overlap=True)
        train(model, opt, 2)
        if refused:  # a checkpoint of a twin with two groups (opt.state_dict() would flush opt)
            twin = make_model()
            other = DisTrOAdamW([{"params": twin[0].parameters()}, {"params": twin[2].parameters()}], lr=0.01)
            train(twin, other, 1)
            with pytest.raises(ValueError, match="different number of parameter groups"):
                opt.load_state_dict(other.state_dict())
        opt.flush()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _trained_state(model, cls=DisTrOAdamW, **settings):
    opt = cls(model.parameters(), lr=0.01, **settings)
    train(model, opt, 1)
    return opt.state_dict()


def _edited(saved, group=None, state0=None):
    """A copy of ``saved`` with ``group`` set in its first param group and ``state0`` applied to the
    state of parameter 0."""
    saved = dict(saved, param_groups=[dict(g) for g in saved["param_groups"]],
                 state={i: dict(st) for i, st in saved["state"].items()})
    saved["param_groups"][0].update(group or {})
    if state0 is not None:
        state0(saved["state"][0])
    return saved


@pytest.mark.parametrize("make, match", [
    (lambda m: _trained_state(m, DeMo), "checkpoint is of a DeMo, not a DisTrOAdamW"),
    (lambda m: _trained_state(m, torch.optim.AdamW), "group 0 lacks compression_bits, compression_chunk"),
    (lambda m: _edited(_trained_state(m), group={"lr": -0.01}), "group 0: Invalid learning rate: -0.01"),
    (lambda m: _edited(_trained_state(m), group={"update": "lion"}), "param group 0: Invalid update: 'lion'"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.pop("step")), "one of delta and step"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.update(delta=st["delta"].long())),
     "delta of parameter 0 is not a floating-point tensor"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.update(delta=st["delta"] * float("nan"))),
     "delta of parameter 0 holds non-finite values"),
    (lambda m: _edited(_trained_state(m, update="adam"),
                       state0=lambda st: st.update(exp_avg=st["exp_avg"][1:])),
     r"exp_avg of parameter 0 is not a tensor of its shape \(32, 16\)"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.update(step="x")),
     "step of parameter 0 is 'x', not a count of steps"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.update(step=torch.tensor(float("nan")))),
     "step of parameter 0 is tensor"),
    (lambda m: _edited(_trained_state(m), state0=lambda st: st.update(step=torch.tensor(-5.0))),
     "step of parameter 0 is tensor"),
    (lambda m: _edited(_trained_state(m, update="adam"),
                       state0=lambda st: st.update(exp_avg=st["exp_avg"] * float("nan"))),
     "exp_avg of parameter 0 holds non-finite values"),
    (lambda m: _edited(_trained_state(m, update="adam"),
                       state0=lambda st: st.update(exp_avg_sq=-st["exp_avg_sq"] - 1)),
     "exp_avg_sq of parameter 0 holds negative values"),
], ids=["DeMo's", "torch AdamW's", "negative lr", "unknown update", "no step", "integer delta", "NaN delta",
        "exp_avg of another shape", "string step", "NaN step", "negative step", "NaN exp_avg",
        "negative exp_avg_sq"])
def test_a_checkpoint_this_optimizer_cannot_resume_is_refused_before_anything_changes(make, match):
    model = make_model()
    saved = make(model)
    target = DisTrOAdamW(model.parameters(), lr=0.01, update="adam")
    train(model, target, 1)
    before = [{k: v.clone() for k, v in target.state[p].items()} for p in model.parameters()]
    groups = [dict(g, params=None) for g in target.param_groups]
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(saved)
    for p, state in zip(model.parameters(), before):
        assert all(torch.equal(state[k], target.state[p][k]) for k in state)
    assert [dict(g, params=None) for g in target.param_groups] == groups


@pytest.mark.parametrize("as_saved", [int, lambda t: torch.tensor(t, dtype=torch.int64)],
                         ids=["int", "int64"])
def test_a_step_count_saved_as_a_number_or_integer_tensor_resumes_like_the_float_one(as_saved):
    runs = []
    for convert in (False, True):
        model = make_model()
        opt = DisTrOAdamW(model.parameters(), lr=0.01, update="adam")
        train(model, opt, 2)
        saved = opt.state_dict()
        if convert:
            saved = _edited(saved)
            for st in saved["state"].values():
                st["step"] = as_saved(int(st["step"]))
        fresh = DisTrOAdamW(model.parameters(), lr=0.01, update="adam")
        fresh.load_state_dict(saved)
        train(model, fresh, 2)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_checkpoint_without_its_delta_layout_entry_is_told_by_the_shapes():
    model = make_model(width=128)
    opt = DisTrOAdamW(model.parameters(), lr=0.01)
    train(model, opt, 2)
    saved = opt.state_dict()
    del saved["delta_layout"]
    fresh = DisTrOAdamW(model.parameters(), lr=0.01)
    fresh.load_state_dict(saved)
    assert all(torch.equal(fresh.state[p]["delta"], opt.state[p]["delta"]) for p in model.parameters())


def test_run_peaks_taken_during_the_transform_select_what_a_separate_pass_selects(monkeypatch):
    """On the CPU in float32 the forward transform hands the top-k each run's peak, taken from cache
    (``DCTTransform.accumulate(peaks=...)``). The steps must be bit-identical to ones where the top-k
    computes the peaks itself, over matrices that share slabs and one that spans several."""
    from distro_opt.momentum import MomentumStacks

    def run(with_peaks):
        if not with_peaks:
            monkeypatch.setattr(MomentumStacks, "peaks", lambda self, layout, j, seg, stack: None)
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
    params_b, deltas_b = run(False)
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert all(torch.equal(a, b) for a, b in zip(deltas_a, deltas_b))


@pytest.mark.parametrize("cls", [DisTrOAdamW, DeMo])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_weight_decay_follows_the_learning_rate_of_each_step(cls, dtype):
    """With zero gradients the sign step is zero and only weight decay moves p: p *= 1 - lr * wd with
    this step's lr, exactly as multiplying by that number, whatever the lr did before."""
    p = torch.nn.Parameter(torch.randn(128, 64).to(dtype))
    expected = p.detach().clone()
    opt = cls([p], lr=0.1, weight_decay=0.1)
    for lr in [0.1, 0.5, 0.5, 0.2]:
        opt.param_groups[0]["lr"] = lr
        p.grad = torch.zeros_like(p)
        opt.step()
        expected.mul_(1 - lr * 0.1)
        assert torch.equal(p.detach(), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_adam_update_of_a_half_precision_parameter_with_no_direction_stays_finite(dtype):
    """Where U = 0 the Adam step is 0 / (0 + eps): eps = 1e-8 is 0 in float16, so the ratio is taken
    in the momentum's float32 before it meets the parameter (torch's AdamW gives NaN here)."""
    p, q = (torch.nn.Parameter(torch.ones(8, 8, dtype=dtype)) for _ in range(2))
    opt = DisTrOAdamW([p, q], lr=0.01, weight_decay=0.0, update="adam")
    p.grad, q.grad = torch.zeros_like(p), torch.randn(8, 8).to(dtype)  # q: so the step is not empty
    opt.step()
    assert torch.equal(p, torch.ones_like(p)) and torch.isfinite(q).all() and (q != 1).any()


def test_weight_decay_of_groups_with_their_own_learning_rates():
    """Two groups whose parameters share a segment, each decayed with its own lr and weight decay."""
    a, b = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    want_a, want_b = a.detach().clone(), b.detach().clone()
    groups = [{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.3, "weight_decay": 0.2}]
    opt = DisTrOAdamW(groups, weight_decay=0.1)
    for _ in range(3):
        a.grad, b.grad = torch.zeros_like(a), torch.zeros_like(b)
        opt.step()
        want_a.mul_(1 - 0.1 * 0.1)
        want_b.mul_(1 - 0.3 * 0.2)
        assert torch.equal(a.detach(), want_a) and torch.equal(b.detach(), want_b)


def test_add_param_group_validates_the_adam_and_outer_step_settings():
    model = make_model()
    opt = DisTrOAdamW(model[0].parameters(), sync_every=4)
    with pytest.raises(ValueError, match="Invalid outer_momentum value: 1.0"):
        opt.add_param_group({"params": model[2].parameters(), "outer_momentum": 1.0})
    # refused, so not kept: the same parameters can then be added with valid settings
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": model[2].parameters(), "outer_momentum": 0.5})
    before = model[2].weight.detach().clone()
    train(model, opt, 1)  # an inner step: the added layer moves
    assert len(opt.param_groups) == 2 and not torch.equal(before, model[2].weight)
