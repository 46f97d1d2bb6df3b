"""Waiting for the processes a test started, with one deadline for all of them."""
from __future__ import annotations

import time


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
