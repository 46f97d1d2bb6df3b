"""DeMo equals an independent, spatial-domain reference of the paper's algorithm (float64)."""
import numpy as np
import pytest
import scipy.fft
import torch

from distro_opt import DeMo, DisTrOAdamW, gemm, reference
from distro_opt.comm import InProcessBackend


def _chunk_slices(shape, chunk):
    blocks = [n // c for n, c in zip(shape, chunk)]
    for block_index in np.ndindex(*blocks):
        yield block_index, tuple(slice(b * c, (b + 1) * c) for b, c in zip(block_index, chunk))


def _largest_divisor(n, target):
    return n if n <= target else max(c for c in range(1, target + 1) if n % c == 0)


class ReferenceDeMo:
    """The paper's Algorithm 1 written plainly: numpy, scipy.fft, one chunk at a time."""

    def __init__(self, params, decay, topk, chunk, world_size):
        self.params = [p.copy() for p in params]
        self.decay, self.topk = decay, topk
        self.chunks = [tuple(_largest_divisor(n, chunk) for n in p.shape) for p in params]
        self.deltas = [[np.zeros_like(p) for p in params] for _ in range(world_size)]
        self.ties = [np.zeros(p.shape, dtype=bool) for p in params]  # entries where sign(~0) was taken

    def step(self, grads_per_worker, lrs, weight_decays):
        """One step; ``lrs`` and ``weight_decays``: each parameter's (its group's) values now."""
        for j, p in enumerate(self.params):
            lr, wd = lrs[j], weight_decays[j]
            chunk = self.chunks[j]
            k = min(self.topk, int(np.prod(chunk)))
            kept = []  # per worker: {(slice, flat index): value}
            for w, grads in enumerate(grads_per_worker):
                delta = self.deltas[w][j]
                delta *= self.decay
                delta += lr * grads[j]
                sent = {}
                for block, sl in _chunk_slices(p.shape, chunk):
                    coeffs = scipy.fft.dctn(delta[sl], norm="ortho").reshape(-1)
                    top = np.argsort(-np.abs(coeffs), kind="stable")[:k]
                    sparse = np.zeros_like(coeffs)
                    sparse[top] = coeffs[top]
                    delta[sl] -= scipy.fft.idctn(sparse.reshape(chunk), norm="ortho")
                    sent.update({(block, int(i)): coeffs[i] for i in top})
                kept.append(sent)
            p *= 1 - lr * wd
            for block, sl in _chunk_slices(p.shape, chunk):
                agg = np.zeros(int(np.prod(chunk)))
                for i in range(agg.size):
                    vals = [s[(block, i)] for s in kept if (block, i) in s]
                    agg[i] = np.mean(vals) if vals else 0.0
                direction = scipy.fft.idctn(agg.reshape(chunk), norm="ortho")
                self.ties[j][sl] |= np.abs(direction) < 1e-12 * max(np.abs(agg).max(), 1e-300)
                p[sl] -= lr * np.sign(direction)


# (96, 130): chunks (16, 13), short runs along the last axis; (48, 64) and (16, 32, 48): top-k over runs of
# scattered chunks; (130,), (8, 4, 3, 3), (): chunks already contiguous
SHAPES = [(96, 130), (48, 64), (16, 32, 48), (130,), (8, 4, 3, 3), ()]


def _run_both(init, grads, dtype, settings, groups_of, lr_at, world_size):
    """DeMo on ``world_size`` in-process workers against the reference, from the same parameters and
    gradients; ``groups_of(params)`` makes the param groups (lr and weight_decay per group);
    ``lr_at(t, base)`` is a schedule's lr at step t. Returns (ours per worker, the reference)."""
    steps = len(grads)
    ref = ReferenceDeMo(
        init, settings["compression_decay"], settings["compression_topk"], settings["compression_chunk"],
        world_size,
    )

    def worker(backend):
        params = [torch.nn.Parameter(torch.from_numpy(x.copy()).to(dtype)) for x in init]
        opt = DeMo(groups_of(params), comm=backend, **settings)
        base = [g["lr"] for g in opt.param_groups]
        for t in range(steps):
            for g, lr in zip(opt.param_groups, base):
                g["lr"] = lr_at(t, lr)
            for p, g in zip(params, grads[t][backend.rank]):
                p.grad = torch.from_numpy(np.array(g)).to(dtype)
            opt.step()
        return [p.detach().double().numpy().copy() for p in params]

    results = InProcessBackend.run(world_size, worker, timeout_s=120)
    probe = [torch.nn.Parameter(torch.zeros(())) for _ in init]
    groups = DeMo(groups_of(probe), **settings).param_groups
    group_of = {id(p): g for g in groups for p in g["params"]}
    for t in range(steps):
        lrs = [lr_at(t, group_of[id(p)]["lr"]) for p in probe]
        ref.step(grads[t], lrs, [group_of[id(p)]["weight_decay"] for p in probe])
    return results, ref


def _data(shapes, world_size, steps, seed=0):
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s) for s in shapes]
    grads = [[[rng.standard_normal(s) for s in shapes] for _ in range(world_size)] for _ in range(steps)]
    return init, grads


@pytest.mark.parametrize("world_size", [1, 3])
def test_demo_matches_reference_step_by_step(world_size):
    init, grads = _data(SHAPES, world_size, steps=4)
    settings = dict(compression_decay=0.9, compression_topk=5, compression_chunk=16, weight_decay=0.1,
                    compression_bits=64)
    one_group = lambda ps: [{"params": ps, "lr": 0.01}]  # noqa: E731
    results, ref = _run_both(init, grads, torch.float64, settings, one_group, lambda t, lr: lr, world_size)
    for ours in results:
        for got, want, ties in zip(ours, ref.params, ref.ties):
            differ = np.abs(got - want) > 1e-9
            # identical except where the reference took the sign of an exact-zero direction (a tie)
            assert not (differ & ~ties).any(), f"{(differ & ~ties).sum()} entries differ without a sign tie"
            assert differ.mean() <= 0.02


def test_demo_matches_reference_with_two_groups_and_a_schedule():
    """Each group's own lr and weight decay (torch's convention: a group's weight_decay replaces the
    constructor's), and an lr that changes every step, as a scheduler changes it."""
    init, grads = _data(SHAPES, 2, steps=5, seed=1)
    settings = dict(compression_decay=0.95, compression_topk=7, compression_chunk=16, weight_decay=0.2,
                    compression_bits=64)

    def groups_of(ps):
        return [{"params": ps[:3], "lr": 0.02}, {"params": ps[3:], "lr": 0.005, "weight_decay": 0.0}]

    results, ref = _run_both(init, grads, torch.float64, settings, groups_of, lambda t, lr: lr * 0.7**t, 2)
    for ours in results:
        for got, want, ties in zip(ours, ref.params, ref.ties):
            differ = np.abs(got - want) > 1e-9
            assert not (differ & ~ties).any(), f"{(differ & ~ties).sum()} entries differ without a sign tie"


def test_demo_defaults_in_float32_match_the_float64_reference_but_for_rounding():
    """The default path (float32, top-32 of 64x64 chunks, float32 values): float32 rounding may pick
    another coefficient at a near-tie or flip the sign of a near-zero direction, nothing more."""
    shapes = [(128, 192), (64, 320), (192,)]
    init, grads = _data(shapes, 2, steps=6, seed=2)
    settings = dict(compression_decay=0.999, compression_topk=32, compression_chunk=64, weight_decay=0.1)
    results, ref = _run_both(
        init, grads, torch.float32, settings, lambda ps: [{"params": ps, "lr": 0.01}], lambda t, lr: lr, 2
    )
    for ours in results:
        for got, want in zip(ours, ref.params):
            differ = np.abs(got - want) > 1e-5
            assert differ.mean() <= 0.002, f"{differ.sum()} of {differ.size} entries differ"



def _reference_run(init, grads, settings, input_scale, lr):
    """``distro_opt.reference`` from the same start, every parameter in one group of ``lr``."""
    params = [torch.from_numpy(x.copy()) for x in init]
    deltas = [[torch.zeros_like(p) for p in params] for _ in grads[0]]
    for step in grads:
        for j, p in enumerate(params):
            workers = [torch.from_numpy(np.array(w[j])) for w in step]
            reference.demo_step(p, workers, [d[j] for d in deltas], lr=lr, input_scale=input_scale, **settings)
    return [p.numpy() for p in params]


REFERENCE_SETTINGS = dict(compression_decay=0.9, compression_topk=5, compression_chunk=16, weight_decay=0.1)


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_products_reference_step_matches_the_scipy_reference(world_size):
    """``distro_opt.reference``, the plain step a newcomer reads first, against this file's
    independent numpy/scipy transcription of Algorithm 1."""
    init, grads = _data(SHAPES, world_size, steps=4, seed=3)
    ref = ReferenceDeMo(init, 0.9, 5, 16, world_size)
    for step in grads:
        ref.step(step, [0.01] * len(SHAPES), [0.1] * len(SHAPES))
    ours = _reference_run(init, grads, REFERENCE_SETTINGS, input_scale=0.01, lr=0.01)
    for got, want, ties in zip(ours, ref.params, ref.ties):
        differ = np.abs(got - want) > 1e-9
        assert not (differ & ~ties).any(), f"{(differ & ~ties).sum()} entries differ without a sign tie"


@pytest.mark.parametrize("slab", ["default slab", "small slab"])
@pytest.mark.parametrize("cls, input_scale", [(DeMo, 0.01), (DisTrOAdamW, 1.0)])
@pytest.mark.parametrize("world_size", [1, 3])
def test_the_fast_step_matches_the_reference_step(cls, input_scale, world_size, slab, monkeypatch):
    """The optimizers' step (segments, own-layout coefficients, top-k over runs, the wire format)
    against ``distro_opt.reference`` in float64 with exact values: DeMo scales its input by the lr,
    DisTrOAdamW does not. With a small slab the CPU's inverse GEMM reuses its workspace several
    times within a segment (as a real model's segments do), here three same-shape matrices."""
    shapes = SHAPES
    if slab == "small slab":
        monkeypatch.setattr(gemm, "SLAB_NUMEL", 5 * 16 * 16)  # 5 chunks of 16 x 16 per slab
        shapes = SHAPES + [(48, 64), (48, 64)]
    init, grads = _data(shapes, world_size, steps=4, seed=4)
    want = _reference_run(init, grads, REFERENCE_SETTINGS, input_scale=input_scale, lr=0.01)

    def worker(backend):
        params = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in init]
        sign = {"update": "sign"} if cls is DisTrOAdamW else {}  # the reference is DeMo's sign step
        opt = cls(params, lr=0.01, comm=backend, compression_bits=64, **sign, **REFERENCE_SETTINGS)
        for step in grads:
            for p, g in zip(params, step[backend.rank]):
                p.grad = torch.from_numpy(np.array(g))
            opt.step()
        return [p.detach().numpy().copy() for p in params]

    for ours in InProcessBackend.run(world_size, worker, timeout_s=120):
        for got, expected in zip(ours, want):
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9)


def test_the_float32_fast_paths_match_the_float64_reference_step_but_for_rounding():
    """float32 matrices of 64x64 chunks take the native kernel (or oneDNN) and the top-k over run
    peaks; float32 rounding may pick another coefficient at a near-tie, nothing more."""
    shapes = [(128, 192), (64, 320), (192,)]
    init, grads = _data(shapes, 2, steps=5, seed=5)
    settings = dict(compression_decay=0.999, compression_topk=4, compression_chunk=64, weight_decay=0.1)
    want = _reference_run(init, grads, settings, input_scale=1.0, lr=0.01)

    def worker(backend):
        params = [torch.nn.Parameter(torch.from_numpy(x.copy()).float()) for x in init]
        opt = DisTrOAdamW(params, lr=0.01, comm=backend, compression_bits=32, update="sign", **settings)
        for step in grads:
            for p, g in zip(params, step[backend.rank]):
                p.grad = torch.from_numpy(np.array(g)).float()
            opt.step()
        return [p.detach().double().numpy().copy() for p in params]

    for ours in InProcessBackend.run(2, worker, timeout_s=120):
        for got, expected in zip(ours, want):
            differ = np.abs(got - expected) > 1e-5
            assert differ.mean() <= 0.002, f"{differ.sum()} of {differ.size} entries differ"
