"""The DHT process a hivemind backend starts for itself: out of the terminal's reach, gone with its owner.

A terminal's Ctrl-C sends SIGINT to every process of the foreground process group. hivemind's DHT
process ignores it, but the p2p daemon that process starts catches it: it may exit, or close the
control socket the peer's streams and DHT calls go through, and a peer interrupted in a terminal
then could not even announce its leave. ``OwnSessionDHT`` starts in a session of its own (its p2p daemon
with it), so only the program gets the Ctrl-C and leaves cleanly; the program ends the DHT through
``DHT.shutdown()`` as before.

Out of the program's process group, the DHT process no longer dies with it when a shell or a test
kills that group. So it watches its owner: once the process that started it is gone (killed,
crashed), it kills its own process group, the p2p daemon included, within ``WATCH_S``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from hivemind import DHT

WATCH_S = 0.5  # how often the DHT process checks that its owner is alive


class OwnSessionDHT(DHT):
    """A ``hivemind.DHT`` whose process (and p2p daemon) runs in its own session and ends with its owner."""

    def start(self) -> None:
        self._owner_pid = os.getpid()  # read again after the fork, in the DHT process
        super().start()

    def run(self) -> None:  # in the DHT process
        os.setsid()
        threading.Thread(target=_die_with, args=(self._owner_pid,), name="owner-watch", daemon=True).start()
        super().run()


def _die_with(owner_pid: int) -> None:
    """Kill this process group (this process and its p2p daemon) once ``owner_pid`` is not our parent."""
    while os.getppid() == owner_pid:
        time.sleep(WATCH_S)
    os.killpg(os.getpgrp(), signal.SIGKILL)
