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
