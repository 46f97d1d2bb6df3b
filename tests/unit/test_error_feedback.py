"""The error-feedback buffer Delta (DeMo, Peng, Quesnelle, Kingma 2024, arXiv 2411.19870,
Algorithm 1): what was not sent, in each parameter's own layout and dtype, and written by no other
parameter."""
import pytest
import torch

from distro_opt import DisTrOAdamW


def test_error_feedback_buffer_is_the_dct_of_the_gradient_minus_what_was_sent_in_the_parameters_shape():
    """One worker, 32-bit values, the sign rule (g itself feeds Delta), first step: Delta = DCT(g) with each chunk's k largest |.| sent and
    zeroed, in the parameter's own layout. Checked against scipy, chunk by chunk."""
    import numpy as np
    import scipy.fft

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(128, 192))
    p.grad = torch.randn(128, 192)
    opt = DisTrOAdamW([p], lr=0.01, compression_topk=4, compression_chunk=64, compression_bits=32, update="sign")
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


def _dct_blocks_with_top_k(g, chunk, k):
    """scipy's orthonormal DCT of every chunk of ``g`` (1-D or 2-D), and each chunk's top-k positions:
    [(block slice, coefficients, flat top-k indices)]."""
    import numpy as np
    import scipy.fft

    blocks = []
    starts = [range(0, n, c) for n, c in zip(g.shape, chunk)]
    for corner in (np.array(np.meshgrid(*starts, indexing="ij")).reshape(len(chunk), -1).T):
        sl = tuple(slice(a, a + c) for a, c in zip(corner, chunk))
        coeffs = scipy.fft.dctn(g[sl], norm="ortho")
        blocks.append((sl, coeffs, np.argsort(-np.abs(coeffs).reshape(-1))[:k]))
    return blocks


# shapes that reach the three ways top-k reads the momentum: runs along the last axis, chunk-major
# rows (1-D), and a chunk too narrow for runs (copied to rows and back)
@pytest.mark.parametrize("shape", [(128, 192), (4096,), (40, 12)])
@pytest.mark.parametrize("feedback", ["kept", "sent"])
def test_error_feedback_subtracts_the_kept_values_or_what_the_receivers_dequantize(shape, feedback):
    """1-bit values, first step. ``error_feedback="kept"``: Delta = DCT(g) with each chunk's top-k
    zeroed, as with exact values. ``"sent"``: at the top-k, Delta = c - sign(c) * mean|top-k of the
    chunk| (the 1-bit codec's scale, rounded to bf16); elsewhere DCT(g) in both. Checked against scipy."""
    import numpy as np

    from distro_opt.dct import chunk_shape

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = torch.randn(shape)
    opt = DisTrOAdamW([p], lr=0.01, compression_topk=4, compression_chunk=64, compression_bits=1,
                      error_feedback=feedback, update="sign")
    opt.step()
    delta = opt.state[p]["delta"].double().numpy()
    for sl, coeffs, top in _dct_blocks_with_top_k(p.grad.double().numpy(), chunk_shape(shape, 64), 4):
        expected = coeffs.copy().reshape(-1)
        if feedback == "kept":
            expected[top] = 0.0
        else:
            scale = float(torch.tensor(np.abs(expected[top]).mean()).to(torch.bfloat16))
            expected[top] -= np.sign(expected[top]) * scale
        np.testing.assert_allclose(delta[sl].reshape(-1), expected, atol=1e-5)


def test_invalid_error_feedback_is_refused_by_name():
    with pytest.raises(ValueError, match="Invalid error_feedback: 'quantized'"):
        DisTrOAdamW([torch.nn.Parameter(torch.zeros(2))], error_feedback="quantized")


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
