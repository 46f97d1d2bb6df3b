"""The one communication interface every backend implements, and the byte-accounting rules.

A backend moves opaque byte buffers between workers and counts them. It never interprets a
payload: decoding and validation belong to the optimizer's wire format (``distro_opt.wire``).
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

REDUCE_OPS = ("mean", "sum")


@dataclass
class CommStats:
    """Cumulative traffic of one worker, in bytes, and the number of collectives it took part in.

    Counting conventions (the only place they live):

    * ``all_gather`` of a B-byte buffer among N workers: each worker sends its B bytes to every
      peer and receives every peer's buffer, so ``sent = received = (N - 1) * B``. A ring
      all-gather moves exactly the same bytes per worker, so the two conventions agree here.
    * ``all_reduce`` of an S-byte tensor among N workers, ring algorithm (what NCCL and Gloo use
      for large tensors): ``sent = received = 2 * (N - 1) / N * S`` per worker.
      ``naive_all_reduce_bytes`` gives the peer-to-peer gather convention, ``(N - 1) * S``, which
      is how the DisTrO report counted its AdamW baseline (31 x 2.4 GB = 74.4 GB per node).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    steps: int = 0

    def record(self, sent: int, received: int) -> None:
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)
        self.steps += 1

    @staticmethod
    def all_gather_bytes(nbytes: int, world_size: int) -> int:
        """Bytes one worker sends (and receives) to all-gather ``nbytes`` among ``world_size``."""
        return (world_size - 1) * nbytes

    @staticmethod
    def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
        """Bytes one worker sends (and receives) in a ring all-reduce of ``nbytes``."""
        return math.ceil(2 * (world_size - 1) * nbytes / world_size)

    @staticmethod
    def naive_all_reduce_bytes(nbytes: int, world_size: int) -> int:
        """Bytes one worker receives when every peer sends it its whole tensor."""
        return (world_size - 1) * nbytes


class PendingGather:
    """Handle of an all-gather started with ``Backend.start_all_gather``; ``wait()`` returns its result."""

    def __init__(self, wait_fn):
        self._wait_fn = wait_fn
        self._result: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            self._result = self._wait_fn()
        return self._result


class Backend(ABC):
    """A group of workers that exchange byte buffers.

    ``all_gather(buf)`` takes this worker's 1-D uint8 buffer and returns the buffers of every
    worker that contributed to this collective, this worker's own included (a fixed world returns
    ``world_size`` buffers in rank order; a peer-to-peer backend may return fewer when peers are
    late or gone). ``all_reduce(tensor, op)`` reduces a tensor in place across all workers.
    """

    rank: int
    world_size: int
    stats: CommStats
    # True for a fixed world whose workers must hold identical replicas: the optimizer then
    # all-gathers a parameter checksum through this backend at its first step and after each
    # load_state_dict, and refuses to train replicas that differ. A backend that keeps replicas in
    # line its own way (hivemind: checksums in the DHT, state downloads) leaves it False.
    compares_replicas: bool = False
    # The share of contributors that may be rogues (0: all trusted). Above 0 the optimizer aggregates
    # with a trimmed mean that bounds what any of them can do (``distro_opt/robust.py``); the backend
    # only states who may be sending, it never looks inside a payload.
    untrusted_fraction: float = 0.0
    # True where one worker's bad payload must not stop the others (peers who join from anywhere):
    # the optimizer then leaves an invalid payload out of the step and calls ``report_invalid``.
    # False (a fixed world of trusted workers): an invalid payload fails the step on every worker.
    drops_invalid_payloads: bool = False

    @abstractmethod
    def all_gather(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Exchange ``buf`` (1-D uint8) with every worker; return all contributed buffers."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce ``tensor`` in place across workers (``op`` in ``REDUCE_OPS``) and return it.

        Implementations call ``check_reduce(tensor, op)`` before anything leaves the worker.
        """

    def start_all_gather(self, buf: torch.Tensor) -> PendingGather:
        """Start an all-gather; the default runs it at once. Backends that can overlap override it."""
        result = self.all_gather(buf)
        return PendingGather(lambda: result)

    def report_invalid(self, index_or_peer) -> None:
        """Told by the optimizer that payload ``index_or_peer`` of the last gather (or that peer's)
        was invalid and left out, where ``drops_invalid_payloads``. A backend may exclude its sender;
        by default nothing happens."""

    def close(self) -> None:
        """Release whatever the backend holds (threads, sockets, peers)."""


def check_buffer(buf: torch.Tensor) -> None:
    """Reject what no backend can send: anything but a 1-D contiguous uint8 tensor."""
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError(f"all_gather expects a 1-D torch.uint8 tensor, got {_describe(buf)}")


def check_reduce(tensor: torch.Tensor, op: str) -> None:
    """Reject an all_reduce no backend can do, before any byte is sent or the tensor is touched.

    The mean of integers is not an integer: a backend would either fail after summing in place
    (the caller's tensor left holding the sum) or truncate. Every backend calls this first, so
    they all refuse the same calls with the same message.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"Invalid reduce op: {op!r} (expected one of {REDUCE_OPS})")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_reduce expects a torch.Tensor, got {_describe(tensor)}")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(
            f"Invalid all_reduce: op='mean' of a {tensor.dtype} tensor (the mean of integers is not "
            "an integer): use op='sum' and divide, or reduce a floating-point tensor"
        )


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {x.dtype} and shape {tuple(x.shape)}"
    return type(x).__name__


class SingleWorkerBackend(Backend):
    """A world of one: what ``comm=None`` means when torch.distributed is not initialized."""

    def __init__(self):
        self.rank = 0
        self.world_size = 1
        self.stats = CommStats()

    def all_gather(self, buf):
        check_buffer(buf)
        self.stats.record(0, 0)
        return [buf.detach().clone()]  # like every backend: the caller may reuse its send buffer

    def all_reduce(self, tensor, op="mean"):
        check_reduce(tensor, op)
        self.stats.record(0, 0)
        return tensor


def warn_at_caller(message: str) -> None:
    """``warnings.warn`` attributed to the first frame outside distro-opt and torch: the user's
    ``step()`` or ``opt.comm`` line (or the trainer's that called it), which is where the warning
    filters' once-per-location applies and what the user needs to see."""
    import distro_opt

    inside = tuple(
        os.path.dirname(os.path.abspath(path)) + os.sep
        for path in (__file__, distro_opt.__file__, torch.__file__)
    )
    level, frame = 2, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)
