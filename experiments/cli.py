"""Command-line plumbing of the experiment scripts: ``--field`` flags generated from a preset
dataclass, so that every preset field can be overridden, and boolean words. The one-line errors and
range-checked numbers they share with the volunteer program live in ``distro_opt.cli_args``."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from distro_opt.cli_args import typed

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
        conv = parse_bool if kind is bool else typed(kind)
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
