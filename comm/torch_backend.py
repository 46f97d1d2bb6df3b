"""torch.distributed backend: real processes (Gloo on CPU, NCCL on GPU), launched with ``torchrun``.

Wraps a process group the user already initialized (the default group, or a sub-group such as the
"across nodes" dimension of a DeviceMesh). The step's payload goes out in ONE all-gather of a
fixed-size uint8 buffer (``all_gather_single``, or ``all_gather_into_tensor`` on older torch).

Framing. Each rank sends ``[8-byte length][payload]`` where every rank's payload slot has the size
the group last agreed on. The length is the backend's own business (it never reads the payload):
it lets every rank see, inside the same single collective, whether some rank's buffer changed
size. Equal new sizes everywhere -> the group agrees on the new size and repeats the gather once;
different sizes -> every rank raises the same ``ValueError``. The first call agrees on the size
this way (its first gather carries the lengths only). The 8 bytes per rank and step are counted in
``stats``: they leave the process like the payload. Why not let torch check sizes: it does not.
Measured with Gloo, an all-gather of unequal buffers gave the rank with the larger buffer
misaligned bytes and killed the other with a C++ ``terminate``.

All-reduce. Gloo does not check that ranks reduce tensors of the same size and dtype either
(measured: 3 against 4 floats gave one rank a plausible sum and left the other waiting; 1000
against 1001 floats, or float32 against float64, killed both with a C++ ``terminate``). So before
the first reduce the ranks agree on the tensor's dtype and shape, by all-gathering a 64-byte text
descriptor. Every reduce then carries one extra element, a flag: a rank whose tensor is not the
agreed one sends zeros of the agreed size with the flag set. Every rank sees the flag sum, so all
go back to the agreement together, which raises the same ``ValueError`` on every rank when the
tensors differ, or agrees on the new shape when every rank changed it. The common case costs one
element and a copy, no second collective; the descriptor bytes are counted in ``stats``. On any
failure the caller's tensor is left as it was.

Timeouts. A process group's timeout is fixed by ``dist.init_process_group(timeout=...)``; a
backend cannot change it. ``timeout_s`` bounds each wait of this backend on top of it
(``Work.wait(timeout)``), so a hung peer makes the others fail after ``timeout_s`` (or sooner if
the group's own timeout fires first). A peer that dies closes its sockets, and Gloo reports that
at once. Either way the failed collective raises ``CollectiveError`` naming the rank, the
collective and the likely cause; the group is unusable afterwards (restart from the last
checkpoint). ``barrier()`` uses ``monitored_barrier`` on Gloo, which names the ranks that did not
arrive.
"""
from __future__ import annotations

import datetime
import hashlib
import weakref

import torch
import torch.distributed as dist

from .base import Backend, CommStats, PendingGather, check_buffer, check_reduce

# int64 payload length in front of each rank's payload, in native byte order (all ranks of one
# job share an architecture; a mixed-endian group would see absurd lengths and raise).
HEADER_BYTES = 8
DESCRIPTOR_BYTES = 64  # an all_reduce tensor's dtype and shape, as text (see the module docstring)


class CollectiveError(RuntimeError):
    """A torch.distributed collective did not complete (a peer died, hung, or diverged)."""


def _all_gather_fn():
    # all_gather_single is the newer name of all_gather_into_tensor (same contract).
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchDistributedBackend(Backend):
    """One rank of an initialized torch.distributed process group, seen as a ``Backend``.

    ``group``: the process group (``None``: the default group). ``timeout_s``: bound on each wait
    for a collective, in seconds (``None``: only the group's own timeout applies).
    """

    compares_replicas = True  # a fixed world of replicas (see ``Backend``)

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "TorchDistributedBackend needs an initialized process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment for it)"
            )
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"Invalid timeout_s: {timeout_s!r} (expected a number > 0, or None)")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("This process is not a member of the process group it was given")
        # held weakly: a strong reference would keep the group alive past the caller's
        # destroy_process_group, to be freed at interpreter exit, where Gloo's teardown can abort
        self._group_ref = None if group is None else weakref.ref(group)
        self.timeout_s = timeout_s
        self._rank = rank
        self._world_size = dist.get_world_size(group)
        self._backend_name = str(dist.get_backend(group)).lower()
        self.stats = CommStats()
        self._capacity = 0  # payload bytes per rank the whole group agreed on; 0 until the first call
        self._reduce_agreed = None  # (descriptor, numel, dtype) of the last all_reduce all ranks agreed on

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None: the default group). ``CollectiveError`` once the caller has
        destroyed it."""
        if self._group_ref is None:
            return None
        group = self._group_ref()
        if group is None:
            raise CollectiveError(
                f"rank {self._rank} of {self._world_size}: the process group was destroyed "
                "(destroy_process_group); this backend cannot be used any more"
            )
        return group

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def device_for(self, tensor: torch.Tensor) -> torch.device:
        """Where a collective on ``tensor`` runs: NCCL needs CUDA memory, Gloo uses CPU memory."""
        has_nccl = "nccl" in self._backend_name
        if tensor.is_cuda and has_nccl:
            return tensor.device
        if has_nccl and "gloo" not in self._backend_name:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- all-gather ----------------------------------------------------------------------------

    def all_gather(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return self.start_all_gather(buf).wait()

    def start_all_gather(self, buf: torch.Tensor) -> PendingGather:
        """Launch the all-gather (``async_op=True``); ``wait()`` checks lengths and returns the buffers."""
        check_buffer(buf)
        device = self.device_for(buf)
        capacity = self._capacity
        frame = self._frame(buf, capacity, device)
        out, work = self._launch(frame)
        if buf.numel() != capacity:  # its bytes go out in wait(): keep them safe from the caller
            buf = buf.clone()
        return PendingGather(lambda: self._finish(buf, device, capacity, out, work))

    def _frame(self, buf: torch.Tensor, capacity: int, device: torch.device) -> torch.Tensor:
        frame = torch.empty(HEADER_BYTES + capacity, dtype=torch.uint8, device=device)
        frame[:HEADER_BYTES].copy_(torch.tensor([buf.numel()], dtype=torch.int64).view(torch.uint8))
        if buf.numel() == capacity:
            frame[HEADER_BYTES:].copy_(buf)
        else:  # a size announcement: the slot is not read, but never send uninitialized memory
            frame[HEADER_BYTES:].zero_()
        return frame

    def _launch(self, frame: torch.Tensor, what: str = "all_gather"):
        out = torch.empty(self._world_size * frame.numel(), dtype=torch.uint8, device=frame.device)
        try:
            work = _all_gather_fn()(out, frame, group=self.group, async_op=True)
        except RuntimeError as exc:
            raise self._error(what, exc) from exc
        return out, work

    def _finish(self, buf, device, capacity, out, work) -> list[torch.Tensor]:
        self._wait(work, "all_gather")
        nbytes = CommStats.all_gather_bytes(HEADER_BYTES + capacity, self._world_size)
        lengths = self._lengths(out, capacity)
        if any(n != capacity for n in lengths):
            if len(set(lengths)) > 1:
                self._refuse(
                    nbytes, "all_gather buffers differ in size", [f"{n} bytes" for n in lengths],
                    "Every rank must send the same number of bytes; do all ranks hold the same model "
                    "and optimizer settings?",
                )
            # Every rank announced the same new size: agree on it and send the payloads now.
            capacity = self._capacity = lengths[0]
            frame = self._frame(buf, capacity, device)
            out, work = self._launch(frame)
            self._wait(work, "all_gather")
            nbytes += CommStats.all_gather_bytes(frame.numel(), self._world_size)
        self.stats.record(nbytes, nbytes)
        if out.device != buf.device:
            out = out.to(buf.device)
        rows = out.view(self._world_size, HEADER_BYTES + capacity)[:, HEADER_BYTES:]
        return list(rows.unbind(0))

    def _refuse(self, nbytes: int, what: str, seen: list[str], advice: str):
        """Count the bytes that crossed, then raise the ValueError every rank raises alike, naming
        what each rank had."""
        self.stats.record(nbytes, nbytes)
        raise ValueError(
            f"{what} across ranks: " + ", ".join(f"rank {r}: {x}" for r, x in enumerate(seen))
            + f" (seen by rank {self._rank}). {advice}"
        )

    def _lengths(self, out: torch.Tensor, capacity: int) -> list[int]:
        headers = out.view(self._world_size, HEADER_BYTES + capacity)[:, :HEADER_BYTES]
        # A fresh aligned copy: an int64 view needs 8-byte aligned rows, the payloads are any size.
        aligned = torch.empty(headers.shape, dtype=torch.uint8).copy_(headers)
        return aligned.view(torch.int64).flatten().tolist()

    # -- all-reduce, barrier -------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce in place (sum, then divide for the mean: every backend supports SUM).

        Every rank takes the same path: all start unagreed, and all see the same flag sum and the
        same descriptors, so none is left in a collective the others skipped.
        """
        check_reduce(tensor, op)
        device = self.device_for(tensor)
        descriptor = _reduce_descriptor(tensor)
        frame, nbytes = None, 0
        if self._reduce_agreed is not None:
            frame, nbytes = self._reduce_frame(tensor, descriptor, device)
        if frame is None or frame[-1].item() != 0:  # first call, or a rank's tensor is not the agreed one
            seen, sent = self._gather_descriptors(descriptor, device)
            nbytes += sent
            if len(set(seen)) > 1:
                self._refuse(
                    nbytes, "all_reduce tensors differ", seen,
                    "Every rank must reduce a tensor of the same shape and dtype.",
                )
            self._reduce_agreed = (descriptor, tensor.numel(), tensor.dtype)
            frame, sent = self._reduce_frame(tensor, descriptor, device)
            nbytes += sent
        self.stats.record(nbytes, nbytes)
        result = frame[:-1]
        if op == "mean":
            result.div_(self._world_size)
        tensor.copy_(result.view(tensor.shape))
        return tensor

    def _reduce_frame(self, tensor, descriptor: bytes, device) -> tuple[torch.Tensor, int]:
        """Sum the agreed frame: the tensor (zeros if it is not the agreed one), then the flag."""
        agreed, numel, dtype = self._reduce_agreed
        frame = torch.zeros(numel + 1, dtype=dtype, device=device)
        if descriptor == agreed:
            frame[:-1].copy_(tensor.reshape(-1))
        else:
            frame[-1] = 1
        try:
            work = dist.all_reduce(frame, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        except RuntimeError as exc:
            raise self._error("all_reduce", exc) from exc
        self._wait(work, "all_reduce")
        nbytes = frame.numel() * frame.element_size()
        return frame, CommStats.ring_all_reduce_bytes(nbytes, self._world_size)

    def _gather_descriptors(self, descriptor: bytes, device) -> tuple[list[str], int]:
        """Every rank's all_reduce descriptor, in rank order, and the bytes this rank sent for it."""
        mine = torch.frombuffer(bytearray(descriptor), dtype=torch.uint8).to(device)
        out, work = self._launch(mine, "all_reduce")
        self._wait(work, "all_reduce")
        rows = out.cpu().view(self._world_size, DESCRIPTOR_BYTES)
        seen = [bytes(row.tolist()).rstrip(b"\0").decode("ascii", "replace") for row in rows]
        return seen, CommStats.all_gather_bytes(DESCRIPTOR_BYTES, self._world_size)

    def barrier(self) -> None:
        """Wait for every rank, bounded by ``timeout_s`` (``None``: the group's own timeout); on Gloo
        the error names the missing ranks."""
        if self.timeout_s is not None:
            timeout = datetime.timedelta(seconds=self.timeout_s)
        else:  # monitored_barrier's own default is torch's 30 minutes, not the group's timeout
            timeout = self._group_timeout()
        try:
            if "gloo" in self._backend_name and timeout is not None:
                dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=True)
            else:
                self._wait(dist.barrier(group=self.group, async_op=True), "barrier")
        except RuntimeError as exc:
            raise self._error("barrier", exc) from exc

    def _group_timeout(self) -> datetime.timedelta | None:
        """The timeout the group was created with (private torch API; None where it is missing, and
        barrier() then falls back to a plain barrier, which the group's timeout bounds)."""
        group = self.group if self.group is not None else dist.group.WORLD
        try:
            return group._get_backend(torch.device("cpu")).options._timeout
        except (AttributeError, RuntimeError):
            return None

    def close(self) -> None:
        """Nothing to release: the process group belongs to the caller (``destroy_process_group``)."""

    # -- failures ------------------------------------------------------------------------------

    def _wait(self, work, what: str) -> None:
        try:
            if self.timeout_s is None:
                done = work.wait()
            else:
                done = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise self._error(what, exc) from exc
        if done is False:
            raise self._error(what, RuntimeError("wait() reported the collective as not completed"))

    def _error(self, what: str, exc: BaseException) -> CollectiveError:
        if isinstance(exc, CollectiveError):
            return exc
        bound = f"timeout_s={self.timeout_s:g}" if self.timeout_s is not None else "the group's timeout"
        return CollectiveError(
            f"rank {self._rank} of {self._world_size}: {what} did not complete ({exc}). A peer rank "
            f"probably died, hung for longer than {bound}, or called a different collective. The "
            "process group cannot be used any more (destroy_process_group may block too): exit and "
            "restart the job from the last checkpoint."
        )


def _reduce_descriptor(tensor: torch.Tensor) -> bytes:
    """What all ranks' all_reduce tensors must share, as fixed-size text the error message shows."""
    text = f"{tensor.dtype} of shape {tuple(tensor.shape)}"
    if len(text) > DESCRIPTOR_BYTES:  # a shape of many dimensions: its digest still tells it apart
        text = f"{tensor.dtype} of shape #{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}"
    return text.encode("ascii").ljust(DESCRIPTOR_BYTES, b"\0")
