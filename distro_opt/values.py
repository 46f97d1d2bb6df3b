"""Bit packing and the value codecs of the wire format (one codec per ``compression_bits``).

Every codec works on a (num_chunks, k) matrix of top-k coefficients and stores them in a fixed
number of bytes, so a payload's size depends only on the model's shapes and the settings.

| bits | stored                                  | bytes for B chunks of k values     |
|------|-----------------------------------------|------------------------------------|
| 64   | float64                                 | 8 B k                              |
| 32   | float32                                 | 4 B k                              |
| 16   | bfloat16                                | 2 B k                              |
| 8    | int8 levels of a per-chunk scale        | B k + 2 B (bf16 scale = absmax)     |
| 2    | 4 levels {-1, -1/3, 1/3, 1} x scale     | ceil(2 B k / 8) + 2 B (absmax)      |
| 1    | sign x per-chunk magnitude              | ceil(B k / 8) + 2 B (mean abs)      |

The 1-bit codec's magnitude is the mean absolute value of the chunk's kept coefficients, the scale
that minimises the squared error of a sign code (as in 1-bit SGD / signSGD with scaling).
"""
from __future__ import annotations

import functools
import math

import torch


SCALE_NBYTES = 2  # per-chunk scales travel as bfloat16: fp32 range, 8 significant bits


class PayloadError(ValueError):
    """A received payload is malformed; the message says what is wrong."""


def packed_nbytes(count: int, nbits: int) -> int:
    return (count * nbits + 7) // 8


def _word(nbits: int) -> tuple[int, int] | None:
    """(values, bytes) per word: the fewest values of ``nbits`` bits that end on a byte boundary,
    when they fit in an int64 with room to spare (lcm(nbits, 8) <= 56 bits), else None."""
    bits = nbits * 8 // math.gcd(nbits, 8)
    return (bits // nbits, bits // 8) if bits <= 56 else None


def pack_bits(values: torch.Tensor, nbits: int) -> torch.Tensor:
    """Pack non-negative integers < 2**nbits, little-endian bit order, into a uint8 tensor: bit b
    of value i is bit (i * nbits + b) % 8 of byte (i * nbits + b) // 8."""
    flat = values.reshape(-1).to(torch.int64)
    nbytes = packed_nbytes(flat.numel(), nbits)
    if nbits == 0 or flat.numel() == 0:
        return torch.empty(nbytes, dtype=torch.uint8, device=values.device)
    word = _word(nbits)
    if word is not None:  # whole words: a handful of operations on the values, not one per bit
        per, width = word
        pad = (-flat.numel()) % per
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        words = (flat.view(-1, per) << torch.arange(0, per * nbits, nbits, device=flat.device)).sum(1)
        packed = words.unsqueeze(1) >> torch.arange(0, 8 * width, 8, device=flat.device)
        return (packed & 0xFF).to(torch.uint8).reshape(-1)[:nbytes]
    shifts = torch.arange(nbits, device=flat.device)
    bits = ((flat.unsqueeze(1) >> shifts) & 1).reshape(-1)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = 1 << torch.arange(8, device=flat.device)  # made on the device: no copy from the host
    return (bits.reshape(-1, 8) * weights).sum(1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, nbits: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``count`` integers of ``nbits`` bits as int64."""
    if nbits == 0:
        return torch.zeros(count, dtype=torch.int64, device=data.device)
    word = _word(nbits)
    if word is not None:
        per, width = word
        raw = data.to(torch.int64)
        pad = -(-count // per) * width - raw.numel()
        if pad:
            raw = torch.cat([raw, raw.new_zeros(pad)])
        words = (raw.view(-1, width) << torch.arange(0, 8 * width, 8, device=data.device)).sum(1)
        fields = words.unsqueeze(1) >> torch.arange(0, per * nbits, nbits, device=data.device)
        return (fields & ((1 << nbits) - 1)).reshape(-1)[:count]
    shifts = torch.arange(8, device=data.device)
    bits = ((data.to(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)[: count * nbits]
    weights = torch.ones(nbits, dtype=torch.int64, device=data.device) << torch.arange(nbits, device=data.device)
    return (bits.reshape(count, nbits) * weights).sum(1)


def _bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)


def _bf16_from_bytes(data: torch.Tensor) -> torch.Tensor:
    return data.clone().view(torch.bfloat16).float()  # clone: the slice may be unaligned


class FloatValues:
    """Values stored as a floating-point dtype (no scale)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def nbytes(self, num_chunks: int, k: int) -> int:
        return num_chunks * k * self.itemsize

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (bytes, the values as the receivers will dequantize them)."""
        stored = values.to(self.dtype).contiguous()
        return stored.view(torch.uint8).reshape(-1), stored.to(values.dtype)

    def dequantize(self, data: torch.Tensor, num_chunks: int, k: int) -> torch.Tensor:
        values = data.clone().view(self.dtype).reshape(num_chunks, k)  # clone: may be unaligned
        if not torch.isfinite(values).all():
            raise PayloadError("payload holds non-finite values")
        return values


class ScaledValues:
    """Values quantized to ``nbits`` bits of a per-chunk bf16 scale (8, 2 or 1 bits)."""

    def __init__(self, nbits: int):
        if nbits not in (1, 2, 8):
            raise ValueError(f"Invalid compression_bits for a scaled codec: {nbits}")
        self.nbits = nbits
        self.levels = (1 << nbits) - 1 if nbits > 1 else 1  # 8 bits: 255 levels, -127..127
        self._units: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def nbytes(self, num_chunks: int, k: int) -> int:
        return packed_nbytes(num_chunks * k, self.nbits) + SCALE_NBYTES * num_chunks

    def _scale(self, values: torch.Tensor) -> torch.Tensor:
        mag = values.abs()
        scale = mag.mean(1, keepdim=True) if self.nbits == 1 else mag.amax(1, keepdim=True)
        return scale.to(torch.bfloat16).to(values.dtype)  # what the receivers will see

    def _codes(self, values, scale):
        """Each value's code. NaN gets a valid code (that of 0) instead of an integer cast's garbage:
        the sender checks what it would send for NaN and inf, after encoding (``_compress``)."""
        x = values / torch.where(scale > 0, scale, torch.ones_like(scale))
        if self.nbits > 1:
            x = torch.nan_to_num(x, nan=0.0)  # +-inf are clamped below
        if self.nbits == 1:
            return (x >= 0).to(torch.int64)
        if self.nbits == 2:
            return torch.clamp(torch.round((x + 1) * 1.5), 0, 3).to(torch.int64)
        return torch.clamp(torch.round(x * 127), -127, 127).to(torch.int64) + 127

    def _unit_values(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Each code's value for a scale of 1, computed on the CPU (cached per dtype and device):
        CUDA divides by a Python number as a multiplication by its reciprocal, which is 1 ulp off
        for 1/127, so a GPU worker computing them itself would dequantize to other values than a CPU one."""
        key = (dtype, device)
        if key not in self._units:
            with torch.inference_mode(False):
                c = torch.arange(1 << self.nbits, dtype=dtype)
                if self.nbits == 1:
                    unit = 2 * c - 1
                elif self.nbits == 2:
                    unit = c / 1.5 - 1
                else:
                    unit = (c - 127) / 127  # code 255 is refused before decoding; its entry is never used
                self._units[key] = unit.to(device)
        return self._units[key]

    def _values(self, codes, scale):
        return self._unit_values(scale.dtype, scale.device).take(codes) * scale

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self._scale(values)
        codes = self._codes(values, scale)
        data = torch.cat([pack_bits(codes, self.nbits), _bf16_bytes(scale)])
        # dequantize in float32 exactly as the receivers do, so the sender subtracts what they add
        return data, self._values(codes, scale.float()).to(values.dtype)

    def dequantize(self, data: torch.Tensor, num_chunks: int, k: int) -> torch.Tensor:
        split = packed_nbytes(num_chunks * k, self.nbits)
        codes = unpack_bits(data[:split], self.nbits, num_chunks * k).reshape(num_chunks, k)
        scale = _bf16_from_bytes(data[split:]).reshape(num_chunks, 1)
        if not torch.isfinite(scale).all() or (scale < 0).any():
            raise PayloadError("payload holds a non-finite or negative chunk scale")
        if self.nbits == 8 and (codes > 254).any():
            raise PayloadError("payload holds an int8 code out of range (255)")
        return self._values(codes, scale)


@functools.lru_cache(maxsize=None)
def value_codec(bits: int):
    """The value codec for ``compression_bits``: one shared instance per width, so each keeps its
    tables across steps (codecs hold no other state)."""
    if bits in (64, 32, 16):
        return FloatValues({64: torch.float64, 32: torch.float32, 16: torch.bfloat16}[bits])
    if bits in (8, 2, 1):
        return ScaledValues(bits)
    raise ValueError(f"Invalid compression_bits: {bits} (expected one of 64, 32, 16, 8, 2, 1)")
