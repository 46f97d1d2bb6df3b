"""Writing the runner's small text files so that a reader never sees half of one."""
from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename: a kill mid-write
    leaves the old file or none, never a torn one (that a resume would take for a finished arm, a
    run's identity or a complete cache, or a peer for a complete address list)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


LOCK_NAME = ".lock"


def lock_directory(directory: Path):
    """An exclusive lock on ``directory`` (``fcntl.flock`` on a ``.lock`` file in it), held until the
    returned file is closed or the process ends (a killed run leaves no stale lock); None where the
    platform has no flock. Raises BlockingIOError while another process holds it."""
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    handle = open(Path(directory) / LOCK_NAME, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        handle.close()
        raise
    return handle
