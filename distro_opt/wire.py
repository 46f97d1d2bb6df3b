"""The wire format: every parameter's top-k coefficients of one step packed into ONE uint8 buffer.

Layout of a payload (all sizes fixed by the shapes and settings, known before any step):

    header     12 bytes: magic b"DT", format version, flags (bit 0: this worker contributes),
               8-byte layout fingerprint (SHA-256 of every parameter's shape, chunk, k and bits)
    segment 0  the chunks of every parameter sharing one (chunk shape, k, bits), stacked in
               parameter order: their indices, bit-packed with ceil(log2(chunk_numel)) bits each
               (12 bits for 64x64 chunks), then their values in the codec of ``compression_bits``
               (see ``values.py``)
    segment 1  ...

Segments let one step pack, unpack, aggregate and invert a whole group of same-shaped chunks in a
few tensor operations instead of a few per parameter (a transformer has a handful of segments and
dozens of parameters).

Decoding validates the header, the length, every index and every value before returning anything,
so a bad payload raises ``PayloadError`` (a ``ValueError``) and nothing is applied from it.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .values import PayloadError, pack_bits, packed_nbytes, unpack_bits, value_codec
from .dct import chunk_shape

MAGIC = b"DT"
FORMAT_VERSION = 1
HEADER_NBYTES = 12
FLAG_CONTRIBUTES = 1


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter travels: its shape, DCT chunk shape, kept coefficients per chunk, value bits."""

    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    k: int
    bits: int

    @property
    def num_chunks(self) -> int:
        return math.prod(tuple(self.shape) or (1,)) // self.chunk_numel

    @property
    def chunk_numel(self) -> int:
        return math.prod(self.chunk)


def param_spec(shape, topk: int, chunk_target: int, bits: int) -> ParamSpec:
    """The spec of a parameter of ``shape`` under the group settings (k is capped at the chunk size)."""
    chunk = chunk_shape(tuple(shape), chunk_target)
    value_codec(bits)  # validates bits
    return ParamSpec(tuple(shape), chunk, min(topk, math.prod(chunk)), bits)


@dataclass
class Segment:
    """The chunks of the parameters ``members`` (indices into the layout's specs), stacked by rows."""

    chunk: tuple[int, ...]
    k: int
    bits: int
    members: list[int]
    rows: list[tuple[int, int]]  # each member's (first row, end row) in the stack
    offset: int = 0

    @property
    def num_chunks(self) -> int:
        return self.rows[-1][1]

    @property
    def chunk_numel(self) -> int:
        return math.prod(self.chunk)

    @property
    def index_bits(self) -> int:
        return (self.chunk_numel - 1).bit_length()

    @property
    def index_nbytes(self) -> int:
        return packed_nbytes(self.num_chunks * self.k, self.index_bits)

    @property
    def nbytes(self) -> int:
        return self.index_nbytes + value_codec(self.bits).nbytes(self.num_chunks, self.k)


class PayloadLayout:
    """The segments of the step's buffer, their offsets, the total size and the fingerprint."""

    def __init__(self, specs: list[ParamSpec]):
        self.specs = list(specs)
        self.segments: list[Segment] = []
        by_key: dict[tuple, Segment] = {}
        for i, spec in enumerate(self.specs):
            key = (spec.chunk, spec.k, spec.bits)
            if key not in by_key:
                by_key[key] = Segment(spec.chunk, spec.k, spec.bits, [], [])
                self.segments.append(by_key[key])
            seg = by_key[key]
            start = seg.rows[-1][1] if seg.rows else 0
            seg.members.append(i)
            seg.rows.append((start, start + spec.num_chunks))
        offset = HEADER_NBYTES
        for seg in self.segments:
            seg.offset = offset
            offset += seg.nbytes
        self.nbytes = offset
        desc = repr([(s.shape, s.chunk, s.k, s.bits) for s in self.specs]).encode()
        self.fingerprint = hashlib.sha256(desc).digest()[:8]

    def header(self, contributes: bool) -> torch.Tensor:
        raw = MAGIC + bytes([FORMAT_VERSION, FLAG_CONTRIBUTES if contributes else 0]) + self.fingerprint
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def pack(self, parts: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        """Pack (indices (rows, k), value bytes) of every segment; ``None``: a non-contributing payload."""
        buf = torch.zeros(self.nbytes, dtype=torch.uint8)
        buf[:HEADER_NBYTES] = self.header(contributes=parts is not None)
        if parts:
            # the segments are packed where they live and cross to the host in one copy (on a GPU
            # each copy waits for the device)
            pieces = []
            for seg, (idx, vbytes) in zip(self.segments, parts):
                pieces += [pack_bits(idx, seg.index_bits), vbytes.reshape(-1)]  # index_nbytes, then the values
            one_device = len({t.device for t in pieces}) == 1
            buf[HEADER_NBYTES:] = torch.cat(pieces).cpu() if one_device else torch.cat([t.cpu() for t in pieces])
        return buf

    def unpack(self, buf: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Validate ``buf`` and return per segment (indices (rows, k), values (rows, k)), or ``None`` when
        the sender did not contribute this step. Raises ``PayloadError`` naming what is wrong."""
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
            raise PayloadError("payload is not a 1-D uint8 tensor")
        if buf.numel() != self.nbytes:
            raise PayloadError(
                f"payload layout mismatch: {buf.numel()} bytes received, {self.nbytes} expected "
                "(workers must have the same model, parameter order and compression settings)"
            )
        head = bytes(buf[:HEADER_NBYTES].tolist())
        if head[:2] != MAGIC or head[2] != FORMAT_VERSION:
            raise PayloadError("payload header is not a distro-opt payload of this format version")
        if head[4:] != self.fingerprint:
            raise PayloadError(
                "payload layout mismatch: the sender's layout fingerprint differs from this worker's "
                "(workers must have the same model, parameter order and compression settings)"
            )
        if head[3] & ~FLAG_CONTRIBUTES:
            raise PayloadError(f"payload header has unknown flags {head[3]:#x}")
        if not head[3] & FLAG_CONTRIBUTES:
            return None
        out = []
        for j, seg in enumerate(self.segments):
            count = seg.num_chunks * seg.k
            idx = unpack_bits(buf[seg.offset : seg.offset + seg.index_nbytes], seg.index_bits, count)
            if (idx >= seg.chunk_numel).any():
                raise PayloadError(f"payload index out of range in segment {j} (chunk of {seg.chunk_numel})")
            if seg.k > 1:  # a sender's top-k names distinct coefficients: a repeat would count it twice
                ranked = idx.view(seg.num_chunks, seg.k).sort(1).values
                if (ranked[:, 1:] == ranked[:, :-1]).any():
                    raise PayloadError(f"payload repeats an index within a chunk in segment {j}")
            data = buf[seg.offset + seg.index_nbytes : seg.offset + seg.nbytes]
            try:
                values = value_codec(seg.bits).dequantize(data, seg.num_chunks, seg.k)
            except PayloadError as exc:
                raise PayloadError(f"{exc} (segment {j})") from None
            out.append((idx.reshape(seg.num_chunks, seg.k), values))
        return out
