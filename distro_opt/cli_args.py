"""Command-line plumbing shared by the volunteer program (``distro-peer``) and the experiment
scripts: bad input is one ``error:`` line and exit status 2, and numeric flags are range-checked as
they are parsed, so that a count of 0 is refused at once rather than failing later."""

from __future__ import annotations

import argparse
import sys

EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2, nothing written."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; one line is easier to read in CI logs
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` names each option's default, except a default that says nothing (None, False, an
    empty list: an option that is off or absent unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        silent = default is None or default is False or default == [] or default is argparse.SUPPRESS
        if silent or not action.option_strings or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def typed(cast):
    """An argparse type: ``cast(text)``, a ``ValueError`` turned into a one-line usage error."""

    def convert(text):
        try:
            return cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {cast.__name__} value: {text!r}") from None

    convert.__name__ = cast.__name__
    return convert


def at_least(cast, low, exclusive=False):
    """An argparse type: ``cast(text)``, refused as a one-line usage error unless ``>= low`` (``> low``
    with ``exclusive``); what the scripts' numeric flags take (a count of 0 would fail only later)."""
    def convert(text):
        value = typed(cast)(text)
        if value < low or (exclusive and value == low):
            bound = f"{'>' if exclusive else '>='} {low}"
            raise argparse.ArgumentTypeError(f"{text!r}: expected a number {bound}")
        return value

    convert.__name__ = cast.__name__
    return convert


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def os_error_message(exc: OSError) -> str:
    """An OSError as one line naming the path (a file in the way, no permission, a full disk)."""
    where = exc.filename if exc.filename is not None else "a file"
    # mkdir(exist_ok=True) says only "File exists" when a file stands where the directory should be.
    reason = "a file is in the way of a directory" if isinstance(exc, FileExistsError) else exc.strerror
    return f"cannot use {where}: {reason or exc}"
