"""The optional C kernel of the forward transform (``distro_opt/csrc/fdct.c``), loaded with ctypes.

For float32 CPU matrices of 64 x 64 chunks, ``DCTTransform.accumulate`` hands the decayed sum
``out = decay * old + scale * DCT(x)`` and its run peaks to this kernel where setup.py could build it
(Linux, a C compiler) and the CPU has AVX2 or AVX-512: a fast DCT (even/odd splits, 22 instead of 64
multiply-adds per element and axis) in one pass per chunk, in place of two GEMMs and three passes.
Elsewhere, for other chunks and dtypes, or with ``DISTRO_OPT_NATIVE=0`` in the environment, the GEMM
path runs (and there the user's ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` may make its
GEMMs bf16; the kernel stays float32 under that setting). Both give the orthonormal DCT-II to
float32 rounding (not the same bits), and the kernel's results do not depend on the thread count.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import threading

import torch

ENV = "DISTRO_OPT_NATIVE"
CHUNK = (64, 64)
LEVELS = {0: "generic", 1: "AVX2", 2: "AVX-512"}

_lock = threading.Lock()
_loaded: dict = {}
_disabled = [0]  # open ``disabled()`` blocks


def _load():
    """(the library, its instruction-set level) or (None, why not); once per process."""
    with _lock:
        if not _loaded:
            _loaded["lib"], _loaded["level"] = _open()
        return _loaded["lib"], _loaded["level"]


def _open():
    if os.environ.get(ENV, "1") == "0":
        return None, f"disabled by {ENV}=0"
    spec = importlib.util.find_spec("distro_opt._fdct")
    if spec is None or not spec.origin:
        return None, "not built (setup.py builds it on Linux where a C compiler is found)"
    lib = ctypes.CDLL(spec.origin)
    lib.fdct_init.argtypes, lib.fdct_init.restype = [ctypes.c_int], ctypes.c_int
    lib.fdct_accumulate.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float] * 2 + [
        ctypes.c_void_p, ctypes.c_int]
    lib.fdct_accumulate.restype = None
    level = lib.fdct_init(2)
    if level < 1:  # only the AVX2 and AVX-512 copies were measured against the GEMM path
        return None, "this CPU has neither AVX2 nor AVX-512"
    return lib, LEVELS[level]


@contextlib.contextmanager
def disabled():
    """The GEMM path inside the block, process-wide (a benchmark's comparison arm, tests)."""
    with _lock:
        _disabled[0] += 1
    try:
        yield
    finally:
        with _lock:
            _disabled[0] -= 1


def active() -> bool:
    """False inside a ``disabled()`` block (the step plans of ``plan.py`` are cached under it)."""
    return not _disabled[0]


def select_level(level: int) -> str:
    """Run the kernel's copy for instruction-set level ``level`` at most (0 generic, 1 AVX2, 2 AVX-512;
    tests check each copy this CPU can run); returns the one chosen."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(f"the native kernel does not run here ({status()})")
    return LEVELS[lib.fdct_init(level)]


def status() -> str:
    """Which kernel runs ("AVX-512", "AVX2"), or why none does."""
    lib, level = _load()
    return level if lib is not None else f"off: {level}"


def handles(chunk, like: torch.Tensor) -> bool:
    """Whether ``accumulate`` takes tensors like ``like`` cut into ``chunk``."""
    return (
        tuple(chunk) == CHUNK
        and like.dtype == torch.float32
        and like.device.type == "cpu"
        and not (like.requires_grad and torch.is_grad_enabled())
        and not _disabled[0]
        and _load()[0] is not None
    )


def accumulate(xs, old, out, decay: float, scale: float, peaks=None) -> None:
    """``out = decay * old + scale * DCT(x)`` for the matrices ``xs`` (one shape, 64 x 64 chunks),
    ``old``/``out`` flat with their coefficients back to back (``old`` None: zeros), and each run's
    largest magnitude into ``peaks`` (one entry per 64 coefficients along a row; None: none)."""
    lib = _load()[0]
    rows, cols = xs[0].shape
    n, threads = rows * cols, torch.get_num_threads()
    buffers = [out] + ([] if old is None else [old]) + ([] if peaks is None else [peaks])
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in buffers):
        raise ValueError("the native DCT takes contiguous float32 CPU old, out and peaks")
    for i, x in enumerate(xs):
        if type(x) not in (torch.Tensor, torch.nn.Parameter):  # a DTensor's data is not its own memory
            raise ValueError(f"the native DCT takes plain tensors, not a {type(x).__name__} (pass its local shard)")
        if x.dtype != torch.float32 or x.device.type != "cpu" or tuple(x.shape) != (rows, cols):
            raise ValueError(
                f"the native DCT takes float32 CPU matrices of one shape, not {x.dtype} {tuple(x.shape)}"
            )
        x = x.contiguous()
        lib.fdct_accumulate(
            x.data_ptr(),
            None if old is None else old[i * n : (i + 1) * n].data_ptr(),
            out[i * n : (i + 1) * n].data_ptr(),
            rows, cols, decay, scale,
            None if peaks is None else peaks[i * n // 64 : (i + 1) * n // 64].data_ptr(),
            threads,
        )
