"""Wire format: bit packing, value codecs, sizes equal to the formula, and validation of bad input."""
import math

import pytest
import torch

from distro_opt.wire import HEADER_NBYTES, PayloadLayout, param_spec
from distro_opt.values import PayloadError, pack_bits, unpack_bits, value_codec


@pytest.mark.parametrize("nbits", [1, 2, 3, 7, 8, 12, 16])
def test_pack_bits_round_trips(nbits):
    values = torch.randint(0, 1 << nbits, (1001,))
    packed = pack_bits(values, nbits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 * nbits / 8)
    assert torch.equal(unpack_bits(packed, nbits, 1001), values)


@pytest.mark.parametrize("nbits", [1, 2, 3, 6, 7, 8, 12, 13, 16, 19])  # 13 and 19: no whole word fits an int64
@pytest.mark.parametrize("count", [1, 5, 64])
def test_pack_bits_lays_bits_out_little_endian(nbits, count):
    """Against the format written out bit by bit: bit b of value i is bit (i * nbits + b) % 8 of
    byte (i * nbits + b) // 8."""
    values = torch.randint(0, 1 << nbits, (count,))
    want = [0] * math.ceil(count * nbits / 8)
    for i, v in enumerate(values.tolist()):
        for b in range(nbits):
            pos = i * nbits + b
            want[pos // 8] |= ((v >> b) & 1) << (pos % 8)
    assert pack_bits(values, nbits).tolist() == want
    assert torch.equal(unpack_bits(torch.tensor(want, dtype=torch.uint8), nbits, count), values)


@pytest.mark.parametrize("bits, max_rel_err", [(64, 0.0), (32, 1e-7), (16, 4e-3), (8, 4e-3)])
def test_value_codec_round_trip_error_is_bounded(bits, max_rel_err):
    values = torch.randn(50, 8, dtype=torch.float64)
    codec = value_codec(bits)
    data, sent = codec.quantize(values)
    assert data.numel() == codec.nbytes(50, 8)
    decoded = codec.dequantize(data, 50, 8).to(torch.float64)
    torch.testing.assert_close(decoded, sent, rtol=0, atol=1e-12)  # receivers see what the sender subtracts
    scale = values.abs().amax(1, keepdim=True)
    assert ((decoded - values).abs() <= max_rel_err * scale + 1e-12).all()


def test_two_bit_codec_keeps_sign_and_largest_magnitude():
    values = torch.tensor([[1.0, -1.0, 0.3, -0.3]])
    decoded = value_codec(2).dequantize(value_codec(2).quantize(values)[0], 1, 4)
    torch.testing.assert_close(decoded, torch.tensor([[1.0, -1.0, 1 / 3, -1 / 3]]))


def test_one_bit_codec_sends_sign_times_mean_magnitude():
    values = torch.tensor([[2.0, -1.0, 0.5, -0.5]])
    data, sent = value_codec(1).quantize(values)
    assert data.numel() == 1 + 2  # 4 sign bits in one byte + a bf16 scale
    torch.testing.assert_close(sent, torch.tensor([[1.0, -1.0, 1.0, -1.0]]))


def test_default_distro_setting_is_as_lean_as_psyche():
    layout = PayloadLayout([param_spec((4096, 4096), topk=4, chunk_target=64, bits=1)])
    # per 64x64 chunk: 4 x 12-bit indices + 4 sign bits + a 2-byte scale = 8.5 bytes
    assert layout.nbytes == HEADER_NBYTES + 4096 * (4 * 12 + 4) // 8 + 4096 * 2
    assert layout.nbytes / (4096 * 4096) <= 0.0022


def test_payload_size_equals_formula():
    specs = [param_spec((256, 128), 32, 64, 32), param_spec((128,), 32, 64, 16), param_spec((67,), 32, 64, 8),
             param_spec((64, 192), 32, 64, 32)]
    layout = PayloadLayout(specs)
    # (256,128) and (64,192) share a segment: 8 + 3 chunks of 4096, 32 x 12-bit indices + 32 fp32 each
    first = 11 * 32 * 12 // 8 + 11 * 32 * 4
    # (128,): 2 chunks of 64, 6-bit indices, bf16 values
    second = math.ceil(2 * 32 * 6 / 8) + 2 * 32 * 2
    # (67,) prime: 67 chunks of 1, 0 index bits, k=1, int8 + bf16 scale each
    third = 0 + 67 * 1 + 67 * 2
    assert len(layout.segments) == 3
    assert layout.nbytes == HEADER_NBYTES + first + second + third


def _layout_and_payload():
    layout = PayloadLayout([param_spec((96, 64), 8, 64, 32)])
    idx = torch.randperm(96 * 64 // 2)[:16].view(2, 8)  # 2 chunks of 48x64, 12-bit indices, no repeats
    vbytes, _ = value_codec(32).quantize(torch.randn(2, 8))
    return layout, layout.pack([(idx, vbytes)]), idx


def test_decode_returns_what_was_encoded():
    layout, buf, idx = _layout_and_payload()
    (decoded_idx, values), = layout.unpack(buf)
    assert torch.equal(decoded_idx, idx) and values.shape == (2, 8)


def test_decode_rejects_wrong_length():
    layout, buf, _ = _layout_and_payload()
    with pytest.raises(PayloadError, match="layout mismatch: .* bytes received"):
        layout.unpack(buf[:-1])


def test_decode_rejects_other_layout_fingerprint():
    layout, buf, _ = _layout_and_payload()
    other = PayloadLayout([param_spec((64, 96), 8, 64, 32)])  # same size, other shape
    assert other.nbytes == layout.nbytes
    with pytest.raises(PayloadError, match="fingerprint differs"):
        other.unpack(buf)


def test_decode_rejects_index_out_of_range():
    layout, buf, _ = _layout_and_payload()
    bad = buf.clone()
    bad[HEADER_NBYTES : HEADER_NBYTES + 2] = 255  # index 4095 >= 3072 (48 x 64 chunk)
    with pytest.raises(PayloadError, match="index out of range"):
        layout.unpack(bad)


def test_decode_rejects_an_index_repeated_within_a_chunk():
    """A top-k names k distinct coefficients; a payload repeating one would count as two workers
    in the mean (``aggregate``)."""
    layout = PayloadLayout([param_spec((64, 128), 4, 64, 32)])
    idx = torch.tensor([[5, 9, 700, 4000], [1, 2, 3, 4]])
    values = value_codec(32).quantize(torch.randn(2, 4))[0]
    assert layout.unpack(layout.pack([(idx, values)])) is not None
    idx[1, 3] = 2  # chunk 1: 1, 2, 3, 2
    with pytest.raises(PayloadError, match="repeats an index within a chunk"):
        layout.unpack(layout.pack([(idx, values)]))


def test_decode_rejects_non_finite_values():
    layout, buf, _ = _layout_and_payload()
    bad = buf.clone()
    seg = layout.segments[0]
    nan = torch.tensor([float("nan")]).view(torch.uint8)
    bad[seg.offset + seg.index_nbytes : seg.offset + seg.index_nbytes + 4] = nan
    with pytest.raises(PayloadError, match="non-finite"):
        layout.unpack(bad)


def test_decode_rejects_negative_scale():
    layout = PayloadLayout([param_spec((64, 64), 4, 64, 1)])
    buf = layout.pack([(torch.arange(4).view(1, 4), value_codec(1).quantize(torch.ones(1, 4))[0])])
    buf[-2:] = torch.tensor([-1.0], dtype=torch.bfloat16).view(torch.uint8)
    with pytest.raises(PayloadError, match="negative chunk scale"):
        layout.unpack(buf)


def test_non_contributing_payload_decodes_to_none():
    layout, _, _ = _layout_and_payload()
    assert layout.unpack(layout.pack(None)) is None


def test_invalid_bits_rejected():
    with pytest.raises(ValueError, match="Invalid compression_bits: 4"):
        value_codec(4)
