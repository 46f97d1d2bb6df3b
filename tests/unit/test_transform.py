"""The chunked DCT matches scipy's orthonormal DCT-II chunk by chunk, for tensors of any rank."""
import copy
import io

import numpy as np
import pytest
import scipy.fft
import torch

from distro_opt.dct import chunk_size, dct_matrix
from distro_opt.transform import DCTTransform
import distro_opt.native as native_module
import distro_opt.gemm as gemm_module


@pytest.mark.parametrize(
    "n, target, expected",
    [(64, 64, 64), (32, 64, 32), (128, 64, 64), (96, 64, 48), (100, 64, 50), (67, 64, 1), (1, 64, 1), (2048, 64, 64)],
)
def test_chunk_is_largest_divisor_not_above_target(n, target, expected):
    assert chunk_size(n, target) == expected


def test_dct_matrix_matches_scipy_orthonormal_dct2():
    x = np.random.default_rng(0).standard_normal(48)
    ours = dct_matrix(48, torch.float64) @ torch.from_numpy(x)
    np.testing.assert_allclose(ours.numpy(), scipy.fft.dct(x, type=2, norm="ortho"), atol=1e-12)


def _scipy_chunked(x: np.ndarray, chunk):
    """Independent reference: cut into chunks by slicing, dctn each chunk, stack chunk-major."""
    blocks = [n // c for n, c in zip(x.shape, chunk)]
    out = []
    for block_index in np.ndindex(*blocks):
        sl = tuple(slice(b * c, (b + 1) * c) for b, c in zip(block_index, chunk))
        out.append(scipy.fft.dctn(x[sl], type=2, norm="ortho").reshape(-1))
    return np.stack(out)


class _GemmSpy:
    """Stands in for the oneDNN GEMM (or its absence) and counts the calls it gets."""

    def __init__(self, gemm):
        self.gemm, self.calls = gemm, 0

    def __call__(self, *args):
        self.calls += 1
        return self.gemm(*args)


# float64 runs torch.mm; float32 runs oneDNN's GEMM for the forward transform where torch has it,
# and torch.mm when it does not (the "torch" case takes oneDNN away)
GEMMS = [(torch.float64, "torch", 1e-10), (torch.float32, "torch", 2e-5), (torch.float32, "onednn", 2e-5),
         (torch.float32, "native", 2e-5)]


@pytest.fixture
def forward_gemm(request, monkeypatch):
    """Sets what the forward transform may use: torch's GEMMs, oneDNN's (returns the spy on them), or
    the native kernel for float32 matrices of 64 x 64 chunks (returns "native"; the GEMMs elsewhere)."""
    if request.param == "native":
        if not native_module.handles((64, 64), torch.zeros(1)):
            pytest.skip(f"the native kernel does not run here ({native_module.status()})")
        return "native"
    monkeypatch.setattr(native_module, "handles", lambda chunk, like: False)
    if request.param == "torch":
        monkeypatch.setattr(gemm_module, "_ONEDNN_LINEAR", None)
        return None
    real = gemm_module._ONEDNN_LINEAR
    if real is None:
        pytest.skip("this torch build has no oneDNN")
    spy = _GemmSpy(real)
    monkeypatch.setattr(gemm_module, "_ONEDNN_LINEAR", spy)
    return spy


@pytest.mark.parametrize("shape", [(128,), (96, 130), (64, 64), (8, 12, 6, 6), (20, 3, 3), (67, 128)])
@pytest.mark.parametrize("dtype, forward_gemm, atol", GEMMS, indirect=["forward_gemm"])
def test_encode_matches_scipy_dctn_on_every_chunk(shape, dtype, forward_gemm, atol):
    x = np.random.default_rng(1).standard_normal(shape)
    t = DCTTransform()
    chunk = t.chunk_shape(shape, 8 if len(shape) == 4 else 64)
    ours = t.coefficient_rows(torch.from_numpy(x).to(dtype), chunk)
    np.testing.assert_allclose(ours.numpy(), _scipy_chunked(x, chunk), atol=atol)


@pytest.mark.parametrize("shape", [(), (5,), (300, 7), (16, 3, 5, 5), (2, 3, 4, 5, 6)])
def test_decode_inverts_encode_for_any_rank(shape):
    x = torch.randn(shape, dtype=torch.float64)
    t = DCTTransform()
    chunk = t.chunk_shape(shape, 4)
    back = t.from_coefficient_rows(t.coefficient_rows(x, chunk), shape, chunk)
    assert back.shape == x.shape
    torch.testing.assert_close(back, x, atol=1e-12, rtol=0)


def test_transform_preserves_energy():
    x = torch.randn(256, 192, dtype=torch.float64)
    t = DCTTransform()
    coeffs = t.coefficient_rows(x, t.chunk_shape(x.shape, 64))
    assert coeffs.shape == (4 * 3, 64 * 64)
    assert coeffs.pow(2).sum().item() == pytest.approx(x.pow(2).sum().item(), rel=1e-12)


@pytest.mark.parametrize("shape, m", [((128,), 5), ((96, 130), 9), ((96, 130), 200), ((8, 4, 6), 3)])
def test_sparse_decode_equals_dense_decode_with_repeated_indices(shape, m):
    t = DCTTransform()
    chunk = t.chunk_shape(shape, 16)
    numel = int(np.prod(chunk))
    blocks = int(np.prod(shape)) // numel
    idx = torch.randint(0, numel, (blocks, m))
    values = torch.randn(blocks, m, dtype=torch.float64)
    dense = torch.zeros(blocks, numel, dtype=torch.float64).scatter_add_(1, idx, values)
    torch.testing.assert_close(t.inverse_sparse(idx, values, shape, chunk), t.from_coefficient_rows(dense, shape, chunk))


@pytest.mark.parametrize("slab_chunks", [1, 10, 1000])
def test_inverse_sparse_pieces_yields_each_piece_across_slabs(monkeypatch, slab_chunks):
    """Pieces decoded in slabs (several small pieces in one, a long piece alone) equal each piece's
    dense inverse, when each view is used before the next is asked for."""
    monkeypatch.setattr(gemm_module, "SLAB_NUMEL", slab_chunks * 16 * 16)
    t = DCTTransform()
    shapes = [(32, 48), (16, 48), (16, 48), (64, 48), (16, 48), (128, 48)]
    chunk = (16, 16)
    counts = [a * b // 256 for a, b in shapes]
    bounds = np.cumsum([0] + counts)
    idx = torch.randint(0, 256, (bounds[-1], 4))
    values = torch.randn(bounds[-1], 4)
    pieces = [(int(a), int(b), shape) for a, b, shape in zip(bounds[:-1], bounds[1:], shapes)]
    got = [view.clone() for view in t.inverse_sparse_pieces(idx, values, chunk, pieces)]
    dense = torch.zeros(bounds[-1], 256).scatter_add_(1, idx, values)
    assert len(got) == len(shapes)
    for view, (a, b, shape) in zip(got, pieces):
        assert view.shape == t.blocked_shape(shape, chunk)
        torch.testing.assert_close(view.reshape(shape), t.from_coefficient_rows(dense[a:b], shape, chunk), rtol=1e-5, atol=1e-6)


def _scipy_own_layout(x: np.ndarray, chunk) -> np.ndarray:
    """Independent reference: dctn of every chunk, written back in place (the tensor's own layout)."""
    out = np.empty_like(x)
    for block_index in np.ndindex(*[n // c for n, c in zip(x.shape, chunk)]):
        sl = tuple(slice(b * c, (b + 1) * c) for b, c in zip(block_index, chunk))
        out[sl] = scipy.fft.dctn(x[sl], type=2, norm="ortho")
    return out


@pytest.mark.parametrize(
    "shape, target",
    [((128, 192), 64), ((96, 130), 64), ((130,), 64), ((67, 128), 64), ((8, 12, 6, 6), 4), ((20, 3, 3), 64),
     ((8, 7, 6), 4)],
)
@pytest.mark.parametrize("members", [1, 3])
# slabs: the default (one slab here), one first-axis block each, and slabs that cut across tensors
@pytest.mark.parametrize("slab_numel", [gemm_module.SLAB_NUMEL, 1, 5000])
@pytest.mark.parametrize("dtype, forward_gemm, atol", GEMMS, indirect=["forward_gemm"])
def test_accumulate_is_decayed_old_plus_scaled_dct_in_each_tensors_own_layout(
    shape, target, members, slab_numel, dtype, forward_gemm, atol, monkeypatch
):
    monkeypatch.setattr(gemm_module, "SLAB_NUMEL", slab_numel)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(shape) for _ in range(members)]
    old = rng.standard_normal(members * int(np.prod(shape)))
    out = torch.empty(old.size, dtype=dtype)
    t = DCTTransform()
    chunk = t.chunk_shape(shape, target)
    inputs = [torch.from_numpy(x).to(dtype) for x in xs]
    peaks = torch.full((old.size // chunk[-1],), -1.0, dtype=dtype)
    filled = t.accumulate(
        inputs, chunk, torch.from_numpy(old).to(dtype), out, decay=0.9, scale=0.5, peaks=peaks
    )
    want = 0.9 * old + 0.5 * np.concatenate([_scipy_own_layout(x, chunk).reshape(-1) for x in xs])
    np.testing.assert_allclose(out.numpy(), want, atol=atol)
    # the run peaks come with the oneDNN path (matrices in float32) and the native kernel (64 x 64
    # chunks), exactly max |out| of each run
    if forward_gemm == "native":  # the other matrices take oneDNN where this torch has it
        onednn = gemm_module._ONEDNN_LINEAR is not None
        assert filled == (tuple(chunk) == (64, 64) or onednn and DCTTransform.first_and_last_only(chunk))
    else:
        assert filled == (forward_gemm is not None and DCTTransform.first_and_last_only(chunk))
    if filled:
        assert torch.equal(peaks, out.view(-1, chunk[-1]).abs().amax(1))
    # forward / inverse use the same layout
    x = torch.from_numpy(xs[0]).to(dtype)
    np.testing.assert_allclose(t.forward(x, chunk).numpy(), _scipy_own_layout(xs[0], chunk), atol=atol)
    torch.testing.assert_close(t.inverse(t.forward(x, chunk), chunk), x, atol=atol / 10, rtol=0)
    if forward_gemm not in (None, "native"):  # every shape here has a transformed last axis
        assert forward_gemm.calls > 0


@pytest.fixture
def bf16_allowed():
    """torch's process-wide permission for oneDNN to compute float32 matmuls in bf16, given for the
    test (set it back to False inside to take it away) and restored after; on the GEMM path (the
    native kernel, which it does not reach, off)."""
    if not gemm_module._ONEDNN_BF16:
        pytest.skip("this CPU (or this torch build) has no oneDNN bf16 arithmetic")
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision

    def allow(yes=True):
        matmul.fp32_precision = "bf16" if yes else "none"

    allow()
    with native_module.disabled():
        yield allow
    matmul.fp32_precision = before


@pytest.mark.parametrize("shape, members", [((128, 192), 1), ((64, 256), 3)])
def test_accumulate_runs_its_gemms_in_bf16_only_while_the_user_allows_it(shape, members, bf16_allowed):
    """With ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` a matrix's DCT is off by bf16
    rounding (~0.4%, far above float32's), still summed into the float32 momentum with its exact run
    peaks; without it, float32 again, from the same transform."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(shape) for _ in range(members)]
    old = rng.standard_normal(members * int(np.prod(shape)))
    t = DCTTransform()
    chunk = t.chunk_shape(shape, 64)
    dct = np.concatenate([_scipy_own_layout(x, chunk).reshape(-1) for x in xs])
    inputs = [torch.from_numpy(x).float() for x in xs]
    errors = []
    for allowed in (True, False):
        bf16_allowed(allowed)
        out = torch.empty(old.size)
        peaks = torch.empty(old.size // chunk[-1])
        old_t = torch.from_numpy(old).float()
        assert t.accumulate(inputs, chunk, old_t, out, decay=0.9, scale=0.5, peaks=peaks)
        assert torch.equal(peaks, out.view(-1, chunk[-1]).abs().amax(1))
        errors.append(np.linalg.norm(out.numpy() - (0.9 * old + 0.5 * dct)) / np.linalg.norm(0.5 * dct))
        np.testing.assert_allclose(t.forward(inputs[0], chunk).numpy(), _scipy_own_layout(xs[0], chunk),
                                   atol=0.05 if allowed else 2e-5)
    assert 1e-3 < errors[0] < 1e-2
    assert errors[1] < 1e-6


@pytest.mark.parametrize("forward_gemm", ["onednn"], indirect=True)
def test_only_the_forward_transform_uses_onednn(forward_gemm):
    """The inverse, which every worker runs on the same gathered payloads, stays on torch.mm: workers
    whose forward transforms ran different GEMMs still apply bit-identical updates."""
    t = DCTTransform()
    y = torch.randn(128, 192)
    chunk = t.chunk_shape(y.shape, 64)
    idx = torch.randint(0, 64 * 64, (6, 4))
    values = torch.randn(6, 4)
    dense = torch.zeros(6, 64 * 64).scatter_add_(1, idx, values)
    t.inverse(y, chunk)
    t.from_coefficient_rows(dense, y.shape, chunk)
    t.inverse_sparse(idx, values, y.shape, chunk)
    assert forward_gemm.calls == 0
    t.forward(y, chunk)
    assert forward_gemm.calls > 0


@pytest.mark.parametrize("forward_gemm", ["torch", "onednn"], indirect=True)
def test_a_used_transform_deep_copies_and_pickles(forward_gemm):
    """Its caches hold, after oneDNN's forward, a basis in oneDNN's own layout that torch cannot copy:
    copies and pickles leave the caches out and compute the same transform."""
    t = DCTTransform()
    x = torch.randn(128, 192)
    chunk = t.chunk_shape(x.shape, 64)
    expected = t.forward(x, chunk)
    saved = io.BytesIO()
    torch.save(t, saved)
    saved.seek(0)
    for other in (copy.deepcopy(t), torch.load(saved, weights_only=False)):
        assert torch.equal(other.forward(x, chunk), expected)


def test_forward_stays_differentiable_under_autograd():
    """oneDNN's op has no derivative: a tensor that needs grad goes through torch.mm instead."""
    t = DCTTransform()
    x = torch.randn(64, 128, requires_grad=True)
    t.forward(x, (64, 64)).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach(), rtol=1e-5, atol=1e-5)  # orthonormal: d|Dx|^2/dx = 2x


@pytest.mark.parametrize(
    "shape, chunk, is_chunk_major",
    [((128, 192), (64, 64), False), ((4096, 64), (64, 64), True), ((64, 4096), (64, 64), False), ((256,), (64,), True),
     ((6, 10, 4), (3, 5, 2), False), ((8, 4, 3, 3), (8, 4, 3, 3), True)],
)
def test_run_rows_name_each_chunks_runs_along_the_last_axis(shape, chunk, is_chunk_major):
    numel = int(np.prod(shape))
    position = torch.arange(numel).view(shape)  # each element's position in the tensor's own layout
    chunk_major = DCTTransform.chunk_major(position, chunk).reshape(numel // int(np.prod(chunk)), -1)
    run_starts = chunk_major[:, :: chunk[-1]]
    assert torch.equal(DCTTransform.run_rows(shape, chunk), run_starts // chunk[-1])
    assert DCTTransform.own_layout_is_chunk_major(shape, chunk) == is_chunk_major
    assert is_chunk_major == torch.equal(chunk_major.reshape(-1), torch.arange(numel))
