"""The optional C kernel of the forward transform (distro_opt/native.py, distro_opt/csrc/fdct.c): the
same transform as scipy's, every instruction-set copy; run peaks that see NaN; results independent of
the thread count; whole steps that agree with the GEMM path; built wherever CI can build it."""
import os
import platform
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import scipy.fft
import torch

from distro_opt import DCTTransform, DisTrOAdamW, native


def _runs_here() -> bool:
    return native.handles((64, 64), torch.zeros(1))


needs_kernel = pytest.mark.skipif(
    not _runs_here(), reason=f"the native kernel does not run here ({native.status()})"
)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":")[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_the_kernel_is_built_and_used_where_setup_can_build_it():
    """CI's machine (Linux, x86-64, a C compiler, AVX2) must run the kernel: a build that silently
    failed would otherwise leave every test of it skipped."""
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64" and shutil.which("cc")
            and {"avx2", "fma"} <= _cpu_flags()):
        pytest.skip("setup.py builds the kernel only on Linux; it runs with AVX2 or AVX-512")
    assert native.status() in ("AVX2", "AVX-512")


def _reference(x: np.ndarray, old: np.ndarray, decay: float, scale: float) -> np.ndarray:
    """decay * old + scale * dctn of every 64 x 64 chunk (float64, scipy)."""
    out = decay * old.astype(np.float64)
    for i in range(0, x.shape[0], 64):
        for j in range(0, x.shape[1], 64):
            chunk = x[i:i + 64, j:j + 64].astype(np.float64)
            out[i:i + 64, j:j + 64] += scale * scipy.fft.dctn(chunk, norm="ortho")
    return out


@needs_kernel
@pytest.mark.parametrize("level", [2, 1, 0])
def test_every_copy_is_decayed_old_plus_scaled_dct_with_its_run_peaks(level):
    chosen = native.select_level(level)
    try:
        if native.LEVELS[level] != chosen:
            pytest.skip(f"this CPU has no {native.LEVELS[level]} (runs {chosen})")
        rng = np.random.default_rng(level)
        xs = [rng.standard_normal((128, 192)).astype(np.float32) for _ in range(2)]
        old = rng.standard_normal(2 * 128 * 192).astype(np.float32)
        out, peaks = torch.empty(old.size), torch.full((old.size // 64,), -1.0)
        native.accumulate([torch.from_numpy(x) for x in xs], torch.from_numpy(old), out, 0.9, 0.5, peaks)
        n = 128 * 192
        for i, x in enumerate(xs):
            want = _reference(x, old[i * n:(i + 1) * n].reshape(128, 192), 0.9, 0.5)
            np.testing.assert_allclose(out[i * n:(i + 1) * n].view(128, 192).numpy(), want, atol=2e-5, rtol=0)
        assert torch.equal(peaks, out.view(-1, 64).abs().amax(1))
    finally:
        native.select_level(2)


@needs_kernel
def test_forward_takes_the_kernel_and_matches_the_gemm_path():
    x = torch.randn(192, 256)
    t = DCTTransform()
    ours = t.forward(x, (64, 64))
    with native.disabled():
        gemm = t.forward(x, (64, 64))
    assert not torch.equal(ours, gemm)  # another computation, the same transform
    torch.testing.assert_close(ours, gemm, atol=2e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_gives_non_finite_peaks_for_its_chunk_and_no_other(bad):
    x = torch.randn(128, 128)
    x[70, 5] = bad  # chunk (1, 0)
    out, peaks = torch.empty(x.numel()), torch.empty(x.numel() // 64)
    native.accumulate([x], torch.zeros(x.numel()), out, 0.9, 1.0, peaks)
    runs = peaks.view(128, 2)  # run (row, chunk column)
    assert not torch.isfinite(runs[64:, 0]).any()
    assert torch.isfinite(runs[:64]).all() and torch.isfinite(runs[64:, 1]).all()


@needs_kernel
def test_results_do_not_depend_on_the_thread_count():
    x, old = torch.randn(512, 256), torch.randn(512 * 256)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out, peaks = torch.empty(old.numel()), torch.empty(old.numel() // 64)
            native.accumulate([x], old, out, 0.999, 1.0, peaks)
            outs.append((out, peaks))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, outs[0][0]) and torch.equal(p, outs[0][1]) for a, p in outs[1:])


def _train(steps, use_kernel, grad_scale=1.0):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in [(256, 192), (128, 128), (64,), (96, 64)]]
    opt = DisTrOAdamW(params, lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * grad_scale
        if use_kernel:
            opt.step()
        else:
            with native.disabled():
                opt.step()
    return params


@needs_kernel
def test_steps_agree_with_the_gemm_path_but_for_sign_flips_at_near_ties():
    ours, gemm = _train(5, True), _train(5, False)
    for a, b in zip(ours, gemm):
        differ = a != b
        assert differ.float().mean() <= 0.01
        assert ((a - b).abs()[differ] <= 2 * 0.01 * 5 + 1e-6).all()  # at most a few sign steps apart


@needs_kernel
def test_a_worker_with_a_nan_gradient_in_a_kernel_matrix_contributes_nothing():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(128, 128))
    opt = DisTrOAdamW([p], lr=0.01, weight_decay=0.0)
    p.grad = torch.randn(128, 128)
    p.grad[3, 100] = float("nan")
    before = p.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("non-finite local gradient" in str(w.message) for w in caught)
    assert torch.equal(p.detach(), before)  # alone, nobody sent anything: nothing moves
    assert torch.isfinite(opt.state[p]["delta"]).all()


def test_the_environment_switch_turns_the_kernel_off():
    code = "from distro_opt import native; print(native.status())"
    env = {**os.environ, native.ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == f"off: disabled by {native.ENV}=0", out.stderr


@needs_kernel
def test_the_kernel_keeps_float32_under_the_users_bf16_matmul_setting():
    """``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` lets oneDNN's GEMMs round to bf16 on
    the GEMM path; the kernel, about as fast as those, stays float32."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    if matmul is None:
        pytest.skip("this torch has no fp32_precision setting")
    x = torch.randn(128, 192)
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        ours = DCTTransform().forward(x, (64, 64))
    finally:
        matmul.fp32_precision = before
    want = _reference(x.numpy(), np.zeros((128, 192), np.float32), 0.0, 1.0)
    np.testing.assert_allclose(ours.numpy(), want, atol=2e-5, rtol=0)


@needs_kernel
def test_tensors_the_kernel_cannot_read_are_refused_rather_than_read_as_float32():
    with pytest.raises(ValueError, match="float32 CPU matrices of one shape, not torch.bfloat16"):
        native.accumulate([torch.zeros(64, 64, dtype=torch.bfloat16)], None, torch.empty(4096), 0.0, 1.0)
    with pytest.raises(ValueError, match="contiguous float32 CPU old, out and peaks"):
        native.accumulate([torch.zeros(64, 64)], None, torch.empty(8192)[::2], 0.0, 1.0)
