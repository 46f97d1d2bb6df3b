"""Waiting for the processes a test started, with one deadline for all of them."""
from __future__ import annotations

import time


def wait_all(procs, timeout_s: float) -> list[tuple[int | None, str]]:
    """[(exit code, stderr)] of every process (started with ``stderr=PIPE, text=True``), waited for at
    most ``timeout_s`` in all; any still running then is killed (the wait raises TimeoutExpired)."""
    deadline, out = time.monotonic() + timeout_s, []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return out
