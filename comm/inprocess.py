"""Simulated workers in one process: each worker is a thread, and the collectives block like real ones.

Used by tests and experiments to run N workers on one machine with the exact arithmetic of a real
run (buffers are copied on send and again for each receiver, so no two workers share memory;
results are reduced in rank order on every worker). Calls that a real group could not match (an
all_gather meeting an all_reduce, all_reduce tensors of different shapes or dtypes) raise the same
``ValueError`` on every worker.
"""
from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence

import torch

from .base import Backend, CommStats, PendingGather, check_buffer, check_reduce

DEFAULT_TIMEOUT_S = 120.0
_POLL_S = 0.1  # how often run() looks for an exception sent to the calling thread (Ctrl-C)


class InProcessGroupError(RuntimeError):
    """A collective of the in-process group could not complete (timeout, or a worker failed)."""


class _Exchange:
    """Rendezvous shared by the workers of one group: round r completes when every rank deposited.

    A round's items are freed once every rank is done with it: it collected the round, gave up on
    it (its collect timed out), or dropped the handle of an all-gather it never waited on. Freeing
    on "every rank collected" alone kept abandoned rounds, and their buffers, for the group's life.
    """

    def __init__(self, world_size: int, timeout_s: float):
        self.world_size = world_size
        self.timeout_s = timeout_s
        # Reentrant: ``release`` also runs from a garbage-collected handle, possibly in a thread
        # that already holds the lock.
        self._cond = threading.Condition(threading.RLock())
        self._slots: dict[int, list] = {}
        self._done: dict[int, set[int]] = {}  # round -> ranks that will not read it again
        self._aborted: str | None = None

    def deposit(self, round_id: int, rank: int, item) -> None:
        """Leave this rank's item for round ``round_id``; items are shared by every reader, never written."""
        with self._cond:
            self._raise_if_aborted()
            slots = self._slots.setdefault(round_id, [None] * self.world_size)
            slots[rank] = item
            self._cond.notify_all()

    def collect(self, round_id: int, rank: int) -> list:
        """Every rank's item of round ``round_id``, once all arrived; ``rank`` is done with it then,
        and also when the wait times out (it gives the round up: a late rank still completes it)."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._aborted is not None
                or all(x is not None for x in self._slots.get(round_id, [None])),
                timeout=self.timeout_s,
            )
            self._raise_if_aborted()
            slots = self._slots.get(round_id, [None] * self.world_size)
            self._release(round_id, rank)
            if not done:
                missing = [r for r, x in enumerate(slots) if x is None]
                raise InProcessGroupError(
                    f"collective #{round_id} timed out after {self.timeout_s:g} s "
                    f"waiting for ranks {missing}"
                )
            return list(slots)

    def release(self, round_id: int, rank: int) -> None:
        """``rank`` will not collect round ``round_id`` (it dropped the handle); free it if all are done."""
        with self._cond:
            self._release(round_id, rank)

    def _release(self, round_id: int, rank: int) -> None:
        if round_id not in self._slots:  # freed already, or aborted
            return
        done = self._done.setdefault(round_id, set())
        done.add(rank)
        if len(done) == self.world_size:  # each rank deposited before it could be done
            del self._slots[round_id], self._done[round_id]

    def abort(self, reason: str) -> None:
        with self._cond:
            if self._aborted is None:
                self._aborted = reason
            self._slots.clear()  # every collective of the group raises from now on: nobody reads them
            self._done.clear()
            self._cond.notify_all()

    def _raise_if_aborted(self):
        if self._aborted is not None:
            raise InProcessGroupError(f"in-process group aborted: {self._aborted}")


class InProcessBackend(Backend):
    """One simulated worker of an in-process group. Make a group with ``InProcessBackend.create``."""

    compares_replicas = True  # a fixed world of replicas (see ``Backend``)

    def __init__(self, exchange: _Exchange, rank: int):
        self._exchange = exchange
        self.rank = rank
        self.world_size = exchange.world_size
        self.stats = CommStats()
        self._round = 0

    @classmethod
    def create(cls, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> list["InProcessBackend"]:
        """Return one backend per worker; hand each to the thread that plays that worker."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"Invalid world_size: {world_size!r} (expected an int >= 1)")
        if not timeout_s > 0:
            raise ValueError(f"Invalid timeout_s: {timeout_s!r}")
        exchange = _Exchange(world_size, timeout_s)
        return [cls(exchange, r) for r in range(world_size)]

    def _deposit(self, call: str, item) -> int:
        """Start the next round with this worker's ``item``; ``call`` says what this worker called."""
        self._round += 1
        self._exchange.deposit(self._round, self.rank, (call, item))
        return self._round

    def _collect(self, round_id: int) -> list:
        """Every worker's item of the round, once all arrived, if every worker made the same call.

        Every worker sees every call, so they all raise the same error: none is left waiting, where a
        real group would return garbage or abort the process (see torch_backend).
        """
        deposits = self._exchange.collect(round_id, self.rank)
        calls = [call for call, _ in deposits]
        if len(set(calls)) > 1:
            raise ValueError(
                f"collective #{round_id} differs across workers: "
                + ", ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
                + ". Every worker must make the same calls, with tensors of the same shape and dtype."
            )
        return [item for _, item in deposits]

    def start_all_gather(self, buf: torch.Tensor) -> PendingGather:
        check_buffer(buf)
        round_id = self._deposit("all_gather", buf.detach().clone())

        def finish():
            # each receiver gets its own copies, as from a real network: decoding in place is safe
            bufs = [b.clone() for b in self._collect(round_id)]
            received = sum(b.numel() for i, b in enumerate(bufs) if i != self.rank)
            self.stats.record(CommStats.all_gather_bytes(buf.numel(), self.world_size), received)
            return bufs

        pending = PendingGather(finish)
        # An all-gather started and never waited on (abandoned after an error, or at the end of a
        # run) would keep its round's buffers: dropping the handle counts as being done with it.
        weakref.finalize(pending, self._exchange.release, round_id, self.rank).atexit = False
        return pending

    def all_gather(self, buf):
        return self.start_all_gather(buf).wait()

    def all_reduce(self, tensor, op="mean"):
        check_reduce(tensor, op)
        call = f"all_reduce(op={op!r}) of a {tensor.dtype} tensor of shape {tuple(tensor.shape)}"
        parts = self._collect(self._deposit(call, tensor.detach().clone()))
        total = parts[0].clone()
        for p in parts[1:]:  # rank order on every worker: identical results everywhere
            total.add_(p)
        if op == "mean":
            total.div_(self.world_size)
        tensor.copy_(total)
        nbytes = CommStats.ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        self.stats.record(nbytes, nbytes)
        return tensor

    def abort(self, reason: str) -> None:
        """Make every blocked or future collective of this group raise at once."""
        self._exchange.abort(reason)

    @staticmethod
    def run(
        world_size: int,
        fn: Callable[[Backend], object],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backends: Sequence["InProcessBackend"] | None = None,
    ) -> list:
        """Run ``fn(backend)`` on ``world_size`` worker threads; return their results in rank order.

        If one worker raises, the group is aborted so the others fail fast instead of waiting for
        the timeout, and the first worker's exception is re-raised here. If the calling thread is
        interrupted (Ctrl-C) or fails while it waits, the group is aborted too and the exception is
        re-raised at once, without waiting for the jobs to end: workers blocked in a collective
        raise immediately, the others at their next collective.
        """
        backends = list(backends) if backends is not None else InProcessBackend.create(world_size, timeout_s)

        def play(backend):
            try:
                return fn(backend)
            except BaseException as exc:
                backend.abort(f"worker {backend.rank} raised {type(exc).__name__}: {exc}")
                raise

        pool = ThreadPoolExecutor(max_workers=len(backends), thread_name_prefix="distro-worker")
        try:
            futures = [pool.submit(play, b) for b in backends]
            _wait_for_all(futures)
        except BaseException as exc:
            # Leaving a ``with`` block would join the pool, i.e. wait for every worker's whole job.
            backends[0].abort(f"run() was interrupted by {type(exc).__name__}")
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            # The root cause is the first error that is not a consequence of the abort.
            raise next((e for e in errors if not isinstance(e, InProcessGroupError)), errors[0])
        return [f.result() for f in futures]


def _wait_for_all(futures) -> None:
    """Return once every future is done. Waits in short slices: one wait without a timeout would
    hold off an exception sent to this thread (``_thread.interrupt_main``) until every job ended."""
    while wait(futures, timeout=_POLL_S).not_done:
        pass
