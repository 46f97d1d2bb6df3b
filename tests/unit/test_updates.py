"""The update each step applies: the sign, rms and Adam updates of the aggregate, weight decay with
each step's lr, and maximize."""
import pytest
import torch

from distro_opt import DeMo, DisTrOAdamW
from distro_opt.comm import InProcessBackend

from _models import OPTIMIZERS, batch, make_model, train


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


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_lr_scheduler_sets_the_sign_step_size(cls):
    model = make_model()
    sign = {"update": "sign"} if cls is DisTrOAdamW else {}  # DeMo's only update
    opt = cls(model.parameters(), lr=0.01, weight_decay=0.0, **sign)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 1)
    sched.step()
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 1, start=1)
    biggest = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))
    assert biggest == pytest.approx(0.005, rel=1e-5)


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


@pytest.mark.parametrize("lr", [0.01, torch.tensor(0.01)], ids=["number lr", "tensor lr"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_sign_rule_on_a_whole_group_is_the_rule_written_tensor_by_tensor(lr, weight_decay):
    """The sign rule updates a group's tensors together (foreach ops); the result must be, bit for
    bit, ``p *= 1 - lr * wd; p -= lr * sign(U)`` applied to each tensor on its own, whatever mix of
    dtypes, layouts and zeros in U the group holds."""
    from distro_opt.updates import SignUpdate, WeightDecay

    gen = torch.Generator().manual_seed(0)
    shapes_dtypes = [((8, 4), torch.float32), ((3,), torch.bfloat16), ((4, 4), torch.float16),
                     ((5, 2), torch.float64), ((6, 4), torch.float32)]
    params = [torch.randn(s, generator=gen).to(d) for s, d in shapes_dtypes]
    params[-1] = params[-1].t()  # a non-contiguous parameter, its U in its own shape
    directions = [torch.randn(p.shape, generator=gen, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
                  for p in params]
    directions[0][0] = 0.0  # sign(0) = 0: such entries stay where they are
    group = {"lr": lr, "weight_decay": weight_decay}

    want = [p.clone() for p in params]
    for p, d in zip(want, directions):
        p.mul_(1 - lr * weight_decay)
        p.add_(torch.sign(d).to(p.dtype), alpha=-lr)
    SignUpdate(WeightDecay()).apply(group, params, [d.clone() for d in directions], [{} for _ in params])
    for got, expected in zip(params, want):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("lr", [0.01, torch.tensor(0.01)], ids=["number lr", "tensor lr"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_the_adam_rule_on_a_whole_group_is_adamw_written_tensor_by_tensor(lr, amsgrad):
    """The Adam rule's foreach path against AdamW's formula applied to each tensor on its own, bit for
    bit, over three steps, with tensors at different step counts (one joined the group late) and
    of different dtypes (the moments in float32, or float64 for a float64 parameter)."""
    from distro_opt.updates import AdamUpdate, WeightDecay

    gen = torch.Generator().manual_seed(1)
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float32]
    params = [torch.randn(6, 4, generator=gen).to(d) for d in dtypes]
    group = {"lr": lr, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": amsgrad}
    rule, states = AdamUpdate(WeightDecay()), [{"step": torch.tensor(float(i == 3))} for i in range(4)]
    want = [p.clone() for p in params]
    moments = [[torch.zeros(p.shape, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
                for _ in range(3)] for p in params]
    for _ in range(3):
        directions = [torch.randn(p.shape, generator=gen, dtype=moments[i][0].dtype) for i, p in enumerate(params)]
        for st in states:
            st["step"] += 1
        for p, u, (m, v, v_max), st in zip(want, directions, moments, states):
            t = float(st["step"])
            p.mul_(1 - lr * 0.1)
            m.lerp_(u, 1 - 0.9)
            v.mul_(0.95).addcmul_(u, u, value=1 - 0.95)
            if amsgrad:
                torch.maximum(v_max, v, out=v_max)
            denom = ((v_max if amsgrad else v) / (1 - 0.95**t)).sqrt_().add_(1e-8)
            if p.dtype == denom.dtype:
                p.addcdiv_(m, denom, value=-lr / (1 - 0.9**t))
            else:
                p.add_((m / denom).to(p.dtype), alpha=-lr / (1 - 0.9**t))
        rule.apply(group, params, [u.clone() for u in directions], states)
        for got, expected in zip(params, want):
            assert torch.equal(got, expected)
