"""What the in-process workers of one arm share besides their backend: the step at which they all
stop on Ctrl-C, and the table that averages their train losses. (Under torchrun each rank is its
own process: ``experiments.distributed.DistLossMean`` averages the losses there.)"""

from __future__ import annotations

import threading


class StopSignal:
    """Ctrl-C / SIGTERM for in-process workers, turned into one step at which every worker stops.

    Workers are at most one step apart (every step ends in a collective), so the first worker to
    see the request fixes ``stop_at = its step + 1``; every worker then stops at that same step and
    nobody is left waiting in a collective.
    """

    def __init__(self):
        self._requested = threading.Event()
        self._lock = threading.Lock()
        self.stop_at: int | None = None

    def request(self, *_args) -> None:
        self._requested.set()

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def should_stop(self, step: int) -> bool:
        with self._lock:
            if self.stop_at is None and self._requested.is_set():
                self.stop_at = step + 1
            return self.stop_at is not None and step >= self.stop_at


class LossTable:
    """Mean train loss over in-process workers. Every worker puts its loss, then every worker asks for
    the mean (waiting, bounded, for the slower ones: in overlap mode a step's collective completes
    only during the next step); a step's row is dropped once every worker has read it."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._losses: dict[int, dict[int, float]] = {}
        self._reads: dict[int, int] = {}
        self._cond = threading.Condition()

    def put(self, step: int, rank: int, loss: float) -> None:
        with self._cond:
            self._losses.setdefault(step, {})[rank] = loss
            self._cond.notify_all()

    def mean(self, step: int, world_size: int) -> float:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._losses.get(step, {})) == world_size, self.timeout_s):
                missing = sorted(set(range(world_size)) - set(self._losses.get(step, {})))
                raise RuntimeError(
                    f"train losses of step {step} missing for ranks {missing} after {self.timeout_s} s"
                )
            row = self._losses[step]
            self._reads[step] = self._reads.get(step, 0) + 1
            if self._reads[step] == world_size:
                del self._losses[step], self._reads[step]
        return sum(row[r] for r in range(world_size)) / world_size
