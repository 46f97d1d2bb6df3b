"""A small, safe wire format for a tree of tensors: what a joining peer downloads from a live one.

Peers are strangers, so nothing received is unpickled (``torch.load``, even with
``weights_only=True``, still runs the unpickler on attacker-chosen bytes). The format is:

    b"DSTATE1\\n" | u32 header length | JSON header | raw tensor bytes

The JSON header holds the tree (dicts, lists, numbers, strings, bools, None) with every tensor
replaced by ``{"__tensor__": i}``, and a table ``[{"dtype", "shape", "offset", "nbytes"}]``. Loading
checks every entry (known dtype, non-negative shape, the right byte count) and that the tensors, in
table order, tile the body exactly (each starts where the previous one ends, the last one ends where
the blob does) before it allocates anything; so the tensors made never hold more bytes than were
received, and each is copied out of the buffer.
"""

from __future__ import annotations

import json
import math
import struct

import torch

MAGIC = b"DSTATE1\n"
MAX_HEADER_NBYTES = 64 << 20

DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class StateFormatError(ValueError):
    """A received state blob is malformed; it names what is wrong."""


def dump_state(tree) -> bytes:
    """Serialize ``tree`` (nested dict/list/tuple of tensors and JSON scalars) to bytes."""
    tensors: list[torch.Tensor] = []
    skeleton = _strip(tree, tensors)
    table, offset = [], 0
    for t in tensors:
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"dump_state cannot store tensors of dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        table.append(
            {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "offset": offset, "nbytes": nbytes}
        )
        offset += nbytes
    header = json.dumps({"tree": skeleton, "tensors": table}, allow_nan=False).encode()
    parts = [MAGIC, struct.pack(">I", len(header)), header]
    for t in tensors:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        parts.append(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return b"".join(parts)


def load_state(data: bytes):
    """Parse bytes made by ``dump_state``; raise ``StateFormatError`` on anything malformed."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + 4 or bytes(view[: len(MAGIC)]) != MAGIC:
        raise StateFormatError("state blob does not start with the distro-opt state magic")
    (hlen,) = struct.unpack(">I", view[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if hlen > MAX_HEADER_NBYTES or start + hlen > len(view):
        raise StateFormatError(f"state header length {hlen} is out of bounds")
    try:
        header = json.loads(bytes(view[start : start + hlen]))
        skeleton, table = header["tree"], header["tensors"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StateFormatError(f"state header is not valid JSON of the expected shape: {exc}") from None
    if not isinstance(table, list):
        raise StateFormatError("state tensor table is not a list")
    body = view[start + hlen :]
    entries = [_check_entry(entry, i) for i, entry in enumerate(table)]
    end = 0
    for i, (_, _, offset, nbytes) in enumerate(entries):
        if offset != end:
            raise StateFormatError(f"state tensor {i} does not start where tensor {i - 1} ends")
        end += nbytes
    if end != len(body):
        raise StateFormatError(f"state tensors cover {end} bytes of a {len(body)}-byte body")
    tensors = [_read_tensor(entry, body) for entry in entries]
    return _fill(skeleton, tensors)


def _check_entry(entry, i: int) -> tuple:
    """``(dtype, shape, offset, nbytes)`` of table entry ``i``, each checked; nothing allocated."""
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise StateFormatError(f"state tensor {i} has an unknown dtype")
    shape, offset, nbytes = entry.get("shape"), entry.get("offset"), entry.get("nbytes")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise StateFormatError(f"state tensor {i} has an invalid shape {shape!r}")
    dtype = DTYPES[entry["dtype"]]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (
        not isinstance(offset, int)
        or not isinstance(nbytes, int)
        or offset < 0
        or nbytes != math.prod(shape) * itemsize
    ):
        raise StateFormatError(f"state tensor {i} has inconsistent offset/size")
    return dtype, shape, offset, nbytes


def _read_tensor(entry: tuple, body: memoryview) -> torch.Tensor:
    dtype, shape, offset, nbytes = entry
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = bytearray(body[offset : offset + nbytes])  # a private, writable copy
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


def _strip(obj, tensors: list):
    # dict keys keep their type (optimizer state is keyed by int), so dicts are stored as pairs
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(obj, dict):
        return {"__dict__": [[_strip_key(k), _strip(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_strip(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return {"__float__": repr(obj)}  # keeps nan/inf, which plain JSON cannot
    raise TypeError(f"dump_state cannot store a value of type {type(obj).__name__}")


def _strip_key(k):
    if k is None or isinstance(k, (bool, int, str)):
        return k
    raise TypeError(f"dump_state cannot store a dict key of type {type(k).__name__}")


def _fill(node, tensors: list):
    if isinstance(node, dict):
        if set(node) == {"__tensor__"}:
            i = node["__tensor__"]
            if not isinstance(i, int) or not 0 <= i < len(tensors):
                raise StateFormatError(f"state tree refers to a missing tensor {i!r}")
            return tensors[i]
        if set(node) == {"__dict__"} and isinstance(node["__dict__"], list):
            out = {}
            for pair in node["__dict__"]:
                if not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], (dict, list)):
                    raise StateFormatError("state tree has a malformed dict entry")
                out[pair[0]] = _fill(pair[1], tensors)
            return out
        if set(node) == {"__list__"} and isinstance(node["__list__"], list):
            return [_fill(v, tensors) for v in node["__list__"]]
        if set(node) == {"__float__"} and isinstance(node["__float__"], str):
            try:
                return float(node["__float__"])
            except ValueError:
                raise StateFormatError("state tree has a malformed float") from None
        raise StateFormatError("state tree has an unknown node")
    if node is None or isinstance(node, (bool, int, str, float)):
        return node
    raise StateFormatError("state tree has an unknown node")
