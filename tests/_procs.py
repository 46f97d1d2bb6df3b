"""Starting and waiting for the processes a test starts: one deadline for all of them, and Ctrl-C
delivered as a terminal would."""
from __future__ import annotations

import signal
import time


def default_sigint() -> None:
    """``preexec_fn`` of a process that a test interrupts with SIGINT: a shell starts a command in the
    background with SIGINT ignored, its children inherit that, and Python then never raises
    KeyboardInterrupt; a terminal's Ctrl-C reaches a program with SIGINT at its default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_all(procs, timeout_s: float, stdout: bool = False) -> list[tuple]:
    """[(exit code, stderr)] of every process (started with ``stderr=PIPE, text=True``), waited for at
    most ``timeout_s`` in all; any still running then is killed (the wait raises TimeoutExpired).
    ``stdout``: [(exit code, stdout, stderr)], for processes started with ``stdout=PIPE`` too."""
    deadline, out = time.monotonic() + timeout_s, []
    try:
        for p in procs:
            printed, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out.append((p.returncode, printed, err) if stdout else (p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return out
