"""Arms of an experiment: which optimizer a run trains with, parsed from ``--arms``.

Syntax: arms are comma-separated; an arm is ``kind`` or ``kind:key=value,key=value``
(``adamw``, ``distro``, ``demo``, ``distro:topk=8,bits=2``). A comma followed by ``key=value`` continues
the previous arm's options. Keys are the optimizer's keyword arguments, or the short names in
``ALIASES``. Unknown kinds and options are errors, so a typo never silently runs the default.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

import torch

from distro_opt import DeMo, DisTrOAdamW
from distro_opt.comm import SingleWorkerBackend

ALIASES = {
    "topk": "compression_topk",
    "bits": "compression_bits",
    "chunk": "compression_chunk",
    "decay": "compression_decay",
    "wd": "weight_decay",
}
KINDS = ("adamw", "distro", "demo")
_NOT_OPTIONS = {"self", "params", "comm", "process_group"}


@dataclass(frozen=True)
class Arm:
    label: str  # as written on the command line: names the arm in metrics, plots and summaries
    kind: str
    options: dict = field(default_factory=dict)

    @property
    def slug(self) -> str:
        """The label made safe for a file name."""
        return re.sub(r"[^A-Za-z0-9.+-]+", "_", self.label).strip("_")


def _optimizer_class(kind: str):
    return {"adamw": torch.optim.AdamW, "distro": DisTrOAdamW, "demo": DeMo}[kind]


def _allowed_options(kind: str) -> set[str]:
    return set(inspect.signature(_optimizer_class(kind).__init__).parameters) - _NOT_OPTIONS


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_arms(text: str) -> list[Arm]:
    """``"adamw,distro:topk=8,bits=2"`` -> [Arm("adamw"), Arm("distro:topk=8,bits=2", ...)]."""
    groups: list[list[str]] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            raise ValueError(f"Invalid arms {text!r}: empty entry")
        if "=" in token and ":" not in token:
            if not groups:
                raise ValueError(f"Invalid arms {text!r}: option {token!r} before any arm")
            groups[-1].append(token)
        else:
            groups.append([token])
    arms = [_parse_arm(",".join(g)) for g in groups]
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise ValueError(f"Invalid arms {text!r}: an arm is listed twice")
    return arms


def _parse_arm(label: str) -> Arm:
    kind, _, rest = label.partition(":")
    if kind not in KINDS:
        raise ValueError(
            f"Unknown arm {kind!r} (expected one of {', '.join(KINDS)}, optionally with :key=value options)"
        )
    allowed = _allowed_options(kind)
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise ValueError(f"Invalid option {item!r} of arm {label!r} (expected key=value)")
        name = ALIASES.get(key, key)
        if name not in allowed:
            raise ValueError(
                f"Unknown option {key!r} for arm {kind!r} "
                f"(known: {', '.join(sorted(allowed | set(ALIASES)))})"
            )
        options[name] = _parse_value(value)
    return Arm(label=label, kind=kind, options=options)


def optimizer_kwargs(arm: Arm, preset) -> dict:
    """The preset's hyperparameters, as far as this optimizer takes them, then the arm's options."""
    allowed = _allowed_options(arm.kind)
    base = {
        "lr": preset.lr,
        "betas": (preset.beta1, preset.beta2),
        "eps": preset.eps,
        "weight_decay": preset.weight_decay,
    }
    kwargs = {k: v for k, v in base.items() if k in allowed}
    kwargs.update(arm.options)
    return kwargs


def build_optimizer(arm: Arm, params, preset, backend):
    """The arm's optimizer over ``params``. AdamW's gradient all-reduce is the runner's job."""
    kwargs = optimizer_kwargs(arm, preset)
    if arm.kind == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    return _optimizer_class(arm.kind)(params, comm=backend, **kwargs)


def check_arm(arm: Arm, preset) -> None:
    """Build the arm's optimizer on a dummy parameter, so bad option values fail before any training."""
    try:
        build_optimizer(arm, [torch.nn.Parameter(torch.zeros(2, 2))], preset, SingleWorkerBackend())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Invalid arm {arm.label!r}: {exc}") from None
