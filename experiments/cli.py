"""Command-line plumbing shared by the experiment scripts: one-line errors with exit code 2, and
``--field`` flags generated from a preset dataclass so that every preset field can be overridden."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2, nothing written."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; one line is easier to read in CI logs
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


# What a boolean may be written as, in flags and in arm options alike.
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True}
BOOL_WORDS.update({"0": False, "false": False, "no": False, "off": False})


def parse_bool(text: str) -> bool:
    try:
        return BOOL_WORDS[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"invalid boolean value: {text!r} (expected true or false)"
        ) from None


def _typed(cast):
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
        value = _typed(cast)(text)
        if value < low or (exclusive and value == low):
            bound = f"{'>' if exclusive else '>='} {low}"
            raise argparse.ArgumentTypeError(f"{text!r}: expected a number {bound}")
        return value

    convert.__name__ = cast.__name__
    return convert


def _preset_values(presets: dict, name: str) -> str:
    """Each preset's value of a field, for --help: the dataclass default is only the first preset's,
    so showing it alone would present one preset's value as every preset's default."""
    values = {label: getattr(p, name) for label, p in presets.items()}
    if len(set(map(repr, values.values()))) == 1:
        text = f"every preset: {next(iter(values.values()))!r}"
    else:
        text = ", ".join(f"{label}: {v!r}" for label, v in values.items())
    return text.replace("%", "%%")  # argparse %-formats help strings


def add_preset_flags(parser: argparse.ArgumentParser, preset_cls, presets: dict, skip=("name",)) -> None:
    """One ``--field-name`` flag per dataclass field, typed from its annotation, default None (= the
    chosen preset's value); the help lists each of ``presets``' values ({name: preset})."""
    hints = typing.get_type_hints(preset_cls)
    group = parser.add_argument_group("preset overrides (default: the chosen preset's value)")
    for f in dataclasses.fields(preset_cls):
        if f.name in skip:
            continue
        kind = hints[f.name]
        conv = parse_bool if kind is bool else _typed(kind)
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=conv,
            default=None,
            metavar=kind.__name__.upper(),
            help=f"({_preset_values(presets, f.name)})",
        )


def apply_overrides(preset, args) -> object:
    changes = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(preset)
        if getattr(args, f.name, None) is not None
    }
    return dataclasses.replace(preset, **changes)


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def os_error_message(exc: OSError) -> str:
    """An OSError as one line naming the path (a file in the way, no permission, a full disk)."""
    where = exc.filename if exc.filename is not None else "a file"
    # mkdir(exist_ok=True) says only "File exists" when a file stands where the directory should be.
    reason = "a file is in the way of a directory" if isinstance(exc, FileExistsError) else exc.strerror
    return f"cannot use {where}: {reason or exc}"
