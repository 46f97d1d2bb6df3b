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


def parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean value: {text!r} (expected true or false)")


def _typed(cast):
    def convert(text):
        try:
            return cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {cast.__name__} value: {text!r}") from None

    convert.__name__ = cast.__name__
    return convert


def add_preset_flags(parser: argparse.ArgumentParser, preset_cls, skip=("name",)) -> None:
    """One ``--field-name`` flag per dataclass field, typed from its annotation, default None (= preset's)."""
    hints = typing.get_type_hints(preset_cls)
    group = parser.add_argument_group("preset overrides (default: the preset's value)")
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
            help=f"(preset default: {f.default!r})",
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
