"""The hivemind backend's book of rounds: one ``Round`` per step in flight, which steps are finished,
and the next step to start.

Everything here is touched on the backend's event loop only, except ``RoundBook.next``, which the
training thread advances when it starts a round, and ``out_of_sync``, which the program may set.
"""

from __future__ import annotations

import asyncio


class Round:
    """What this peer knows about one step's gather."""

    def __init__(self, step: int):
        self.step = step
        self.own: bytes | None = None
        self.own_ready = asyncio.Event()
        self.phase1 = asyncio.Event()
        self.finished = asyncio.Event()
        self.changed = asyncio.Event()
        self.gather_deadline = self.vote_deadline = self.deadline = 0.0
        self.payloads: dict[str, bytes] = {}
        self.votes: dict[str, frozenset[bytes]] = {}  # voter -> the payload digests it holds
        self.vote_done: set[str] = set()
        self.no_payload: set[str] = set()  # peers whose payload will not come this round
        self.streams: set[str] = set()
        self.clients: set[str] = set()  # peers whose stream said they are in client mode (FLAG_REPLY)
        self.pushed: set[str] = set()
        self.push_over: set[str] = set()  # our pushes that delivered our payload or failed
        self.late: set[str] = set()
        self.my_vote = b""
        self.tasks: set[asyncio.Task] = set()

    def notify(self) -> None:
        self.changed.set()

    async def wait_until(self, cond, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        while not cond():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return cond()
        return True


class RoundBook:
    """Every round of one backend, from the one it starts next down to the oldest one it logged."""

    def __init__(self):
        self.rounds: dict[int, Round] = {}
        self.finished: set[int] = set()  # finished steps at or above ``low``
        self.low = 0  # every step below it is finished
        self.next = 0  # the step this peer starts next
        self.out_of_sync = False  # set when a round could not be completed like the others did it
        self.left = False  # set when this peer left the run: it starts no round and joins none

    def take_next(self) -> int:
        step, self.next = self.next, self.next + 1
        return step

    def round(self, step: int) -> Round:
        if step not in self.rounds:
            self.rounds[step] = Round(step)
        return self.rounds[step]

    def is_late(self, step: int) -> bool:
        return step < self.low or step in self.finished

    def finish(self, r: Round) -> None:
        """Mark step ``r.step`` finished, drop what is over, wake whatever waits on ``r``."""
        self.finished.add(r.step)
        while self.low in self.finished:
            self.finished.discard(self.low)
            self.rounds.pop(self.low, None)
            self.low += 1
        self.rounds.pop(r.step, None)
        r.phase1.set()
        r.finished.set()

    def leave(self) -> None:
        """This peer takes part in no more rounds: the streams waiting for our payload of a round we
        will not start are answered REJECTED (``GatherStreams.on_gather``), so nobody waits on us."""
        self.left = True
        for r in self.rounds.values():
            if r.own is None:
                r.own_ready.set()

    def cancel_tasks(self) -> None:
        for r in list(self.rounds.values()):
            for t in r.tasks:
                t.cancel()

    def reset(self, step: int) -> None:
        """Start over at ``step`` (after a state download). Rounds before it are dropped; a round at
        or after it that a peer already opened a stream for is kept: the peers that will wait for
        this one there may have contacted it while it was still downloading."""
        for s, r in list(self.rounds.items()):
            if s < step or r.own_ready.is_set():
                for t in r.tasks:
                    t.cancel()
                del self.rounds[s]
        self.finished.clear()
        self.low = self.next = step
