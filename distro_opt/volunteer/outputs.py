"""The volunteer's two output files, ``--maddrs-file`` and ``--out``: new files, never overwritten.
Both are checked before anything starts and written whole (a reader never sees half of one)."""

from __future__ import annotations

import os
from pathlib import Path

from distro_opt.cli_args import UsageError


def check_outputs(maddrs_file: str | None, out: str | None) -> None:
    """An output file that exists is refused now, before anything starts, and so is one whose
    directory is missing or not writable (found only at the end of the run otherwise)."""
    named = [(flag, path) for flag, path in (("--maddrs-file", maddrs_file), ("--out", out)) if path]
    if len(named) == 2 and os.path.abspath(out) == os.path.abspath(maddrs_file):
        raise UsageError(f"--out and --maddrs-file both name {out}; choose two files")
    for flag, path in named:
        if os.path.lexists(path):
            raise UsageError(f"{flag} {path} exists; choose another file (distro-peer overwrites none)")
        parent = Path(path).parent
        if not parent.is_dir():
            raise UsageError(f"{flag} {path}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: directory {parent} is not writable")


def write_new(path, text: str) -> None:
    """Write a file that must not exist, whole or not at all: a temporary file beside it, then a hard
    link to the name, which (unlike a rename) fails if the name is taken (``FileExistsError``).
    Where the file system has no hard links, an exclusive create instead."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        try:
            os.link(tmp, path)
        except FileExistsError as exc:  # it names the temporary file first: name the one that exists
            raise FileExistsError(exc.errno, exc.strerror, str(path)) from None
        except OSError:
            with open(path, "x", encoding="utf-8") as f:
                f.write(text)
    finally:
        tmp.unlink(missing_ok=True)
