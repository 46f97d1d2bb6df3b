"""Arms of an experiment: which optimizer a run trains with, parsed from ``--arms``.

Syntax: arms are comma-separated; an arm is ``kind`` or ``kind:key=value,key=value``
(``adamw``, ``alone``, ``distro``, ``demo``, ``diloco``, ``distro:topk=8,bits=2``; the peer arms
``demo-peer`` and ``powersgd``, whose options ``peer_arms`` lists). A comma followed by ``key=value`` continues
the previous arm's options. Keys are the optimizer's keyword arguments, or the short names in
``ALIASES``. Unknown kinds and options are errors, so a typo never silently runs the default. A value
is read as the type of the optimizer's parameter (a boolean as true/false, yes/no, on/off or 1/0, as
the preset flags take it); one that does not fit is an error too.

Per-parameter-kind settings: ``PART.key=value`` sets a param-group hyperparameter (lr, update,
topk, bits, ...) for one kind of parameter only, e.g. ``distro:embed.update=adam,norm.lr=0.0003``.
``PART`` is ``embed`` (parameters whose name contains "embed"), ``norm`` (other 1-D parameters: norm
gains, biases) or ``matrix`` (the rest); each kind becomes its own param group.

The runner's own options (``runner_options``): a compression warm-up, ``warmup_for=N`` steps at
``warmup_topk=K`` and/or ``warmup_bits=B`` (distro, demo: ``distro:warmup_for=30,warmup_topk=32``),
and the local-step mode's inner optimizer, ``inner=muon`` (distro with H > 1, diloco).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import types
import typing
from dataclasses import dataclass, field

import torch

from distro_opt import DeMo, DisTrOAdamW
from distro_opt.comm import SingleWorkerBackend
from distro_opt.precondition import default_rule

from .cli import BOOL_WORDS
from .peer_arms import PEER_ALIASES, PEER_KINDS, check_peer_options, peer_allowed_options, peer_option_type
from .runner_options import RUNNER_OPTIONS, compression_warmup, inner_optimizer, runner_options, wants_muon

ALIASES = {
    "topk": "compression_topk",
    "bits": "compression_bits",
    "chunk": "compression_chunk",
    "decay": "compression_decay",
    "wd": "weight_decay",
    "H": "sync_every",
    "feedback": "error_feedback",
    **PEER_ALIASES,
}
KINDS = ("adamw", "alone", "distro", "demo", "diloco", *PEER_KINDS)
# The baseline every networked arm must beat first: torch's AdamW on one worker, with the same
# per-worker batch and steps, that never communicates (background.md, "worth the network")
ALONE = "alone"
PARTS = ("embed", "norm", "matrix")
# Not options: what the runner passes itself, a factory (no string names one), and modes its
# training loop does not run (CUDA-graph capture, a differentiable step)
_NOT_OPTIONS = {"self", "params", "comm", "process_group", "inner_optimizer", "capturable", "differentiable"}


@dataclass(frozen=True)
class Arm:
    label: str  # as written on the command line: names the arm in metrics, plots and summaries
    kind: str
    options: dict = field(default_factory=dict)
    # Set on the points of a ``--sweep`` (experiments.sweep): the arm as typed, and this point's values
    base: str = ""
    point: dict = field(default_factory=dict)

    @property
    def slug(self) -> str:
        """The label made safe for a file name."""
        return re.sub(r"[^A-Za-z0-9.+-]+", "_", self.label).strip("_")


# DiLoCo (Douillard et al. 2023, arXiv 2311.08455): inner AdamW, every H steps the pseudo-gradient,
# an outer Nesterov SGD step (lr 0.7, momentum 0.9). DisTrOAdamW's local-step mode with nothing
# compressed: every DCT coefficient sent (an orthonormal transform, so the pseudo-gradient itself),
# as bf16, no error feedback (decay 0). H = 30 suits the runner's short runs (the paper: 500).
DILOCO_SETTINGS = {"sync_every": 30, "outer_lr": 0.7, "outer_momentum": 0.9, "compression_decay": 0.0,
                   "compression_bits": 16}
_DILOCO_FIXED = {"compression_topk", "compression_bits", "compression_decay", "update", "overlap"}


def _optimizer_class(kind: str):
    return {"adamw": torch.optim.AdamW, ALONE: torch.optim.AdamW, "distro": DisTrOAdamW, "demo": DeMo,
            "diloco": DisTrOAdamW}[kind]


def option_default(arm: Arm, name: str):
    """The value an arm runs with when it does not set ``name``: diloco's recipe, else the optimizer's."""
    if arm.kind == "diloco" and name in DILOCO_SETTINGS:
        return DILOCO_SETTINGS[name]
    return inspect.signature(_optimizer_class(arm.kind).__init__).parameters[name].default


def _allowed_options(kind: str) -> set[str]:
    if kind in PEER_KINDS:
        return peer_allowed_options(kind)
    allowed = set(inspect.signature(_optimizer_class(kind).__init__).parameters) - _NOT_OPTIONS
    allowed |= runner_options(kind)
    return allowed - _DILOCO_FIXED if kind == "diloco" else allowed


def _group_keys(kind: str) -> set[str]:
    """Hyperparameters that live in param groups (what a per-kind setting may change). A local
    backend: asking must not touch an initialized torch.distributed default group. Peer arms have
    one group, their own."""
    if kind in PEER_KINDS:
        return set()
    comm = {} if kind in ("adamw", ALONE) else {"comm": SingleWorkerBackend()}
    return set(_optimizer_class(kind)([torch.nn.Parameter(torch.zeros(1))], **comm).defaults)


def param_part(name: str, p: torch.Tensor) -> str:
    """The kind of a named parameter for per-kind settings: embed, norm (1-D) or matrix."""
    if "embed" in name:
        return "embed"
    return "norm" if p.dim() <= 1 else "matrix"


def _option_type(kind: str, name: str):
    """The type an option's value must have (bool, int, float or str), from the optimizer's annotation;
    None when it names no single one of these (betas, inner_optimizer): such values are guessed."""
    if kind in PEER_KINDS:
        return peer_option_type(kind, name)
    if name in RUNNER_OPTIONS:
        return RUNNER_OPTIONS[name]
    hint = typing.get_type_hints(_optimizer_class(kind).__init__).get(name)
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    choices = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    if float in choices:  # torch's ``lr: float | Tensor``
        return float
    return choices[0] if len(choices) == 1 and choices[0] in (bool, int, float, str) else None


def _guess_value(text: str):
    """For options with no single scalar type (betas, inner_optimizer): the value as it looks, left to
    the optimizer's own checks in ``check_arm``."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _parse_value(text: str, kind: str, name: str, label: str):
    """``text`` as the option's type. A boolean takes the words the preset flags take (yes/no, on/off,
    ...): any other word would otherwise stay a non-empty string, which is true, and turn it on."""
    want = _option_type(kind, name)
    if want is None:
        return _guess_value(text)
    if want is bool and text.lower() in BOOL_WORDS:
        return BOOL_WORDS[text.lower()]
    if want in (int, float):
        with contextlib.suppress(ValueError):
            return want(text)
    if want is str:
        return text
    expected = {bool: "true/false, yes/no, on/off or 1/0", int: "an integer", float: "a number"}[want]
    raise ValueError(f"Invalid value {text!r} for option {name!r} of arm {label!r} (expected {expected})")


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
    check_distinct_files(arms)
    return arms


def job_workers(arm: Arm, workers: int) -> int:
    """How many workers train ``arm`` in a run of ``workers``: one for the alone baseline."""
    return 1 if arm.kind == ALONE else workers


def with_alone(arms: list[Arm], workers: int) -> list[Arm]:
    """``arms`` with the alone baseline added after the first AdamW arm, with that arm's options (so
    both train at the same lr), where R can be measured (``experiments.gains``): a run of several
    workers with a data-parallel AdamW arm and no alone arm yet. Its label is ``alone`` plus the
    AdamW arm's options (``alone:lr=0.002``)."""
    adamw = next((i for i, a in enumerate(arms) if a.kind == "adamw"), None)
    if workers < 2 or adamw is None or any(a.kind == ALONE for a in arms):
        return list(arms)
    options = arms[adamw].label.partition(":")[2]
    alone = _parse_arm(ALONE + (":" + options if options else ""))
    out = [*arms[: adamw + 1], alone, *arms[adamw + 1 :]]
    check_distinct_files(out)
    return out


def check_distinct_files(arms: list[Arm]) -> None:
    """Results and checkpoints are named by slug: two arms with one slug would share them, and the
    second would be skipped as already finished. Compared case-blind, as some file systems do."""
    seen: dict[str, Arm] = {}
    for arm in arms:
        other = seen.setdefault(arm.slug.lower(), arm)
        if other is not arm:
            raise ValueError(
                f"Invalid arms: {other.label!r} and {arm.label!r} would share result files "
                f"({arm.slug}-seed*); write one of them differently"
            )


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
        part, dot, sub = key.rpartition(".")
        if dot:
            name, keys = ALIASES.get(sub, sub), _group_keys(kind)
            if part not in PARTS or name not in keys:
                raise ValueError(
                    f"Unknown per-kind option {key!r} for arm {kind!r} (expected PART.key with PART in "
                    f"{', '.join(PARTS)} and key one of {', '.join(sorted(keys))})"
                )
            options[f"{part}.{name}"] = _parse_value(value, kind, name, label)
            continue
        name = ALIASES.get(key, key)
        if name not in allowed:
            raise ValueError(
                f"Unknown option {key!r} for arm {kind!r} "
                f"(known: {', '.join(sorted(allowed | {a for a, k in ALIASES.items() if k in allowed}))})"
            )
        options[name] = _parse_value(value, kind, name, label)
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
    if arm.kind == "diloco":
        kwargs.update(DILOCO_SETTINGS)
    kwargs.update({k: v for k, v in arm.options.items() if "." not in k and k not in RUNNER_OPTIONS})
    return kwargs


def param_groups(arm: Arm, named_params) -> list[dict]:
    """One group per parameter kind, with the arm's ``PART.key`` settings; one plain group when the
    arm has none (and no Muon inner optimizer, which steps the matrices' group only).
    ``named_params`` are (name, parameter) pairs, e.g. ``model.named_parameters()``."""
    named = list(named_params)
    per_part = {}
    for key, value in arm.options.items():
        part, dot, name = key.partition(".")
        if dot:
            per_part.setdefault(part, {})[name] = value
    if not per_part and not wants_muon(arm.options):
        return [{"params": [p for _, p in named]}]
    groups = []
    for part in PARTS:
        params = [p for n, p in named if param_part(n, p) == part]
        if params:
            groups.append({"params": params, **per_part.get(part, {})})
    return groups


def build_optimizer(arm: Arm, named_params, preset, backend):
    """The arm's optimizer over ``named_params`` ((name, parameter) pairs). AdamW's gradient
    all-reduce is the runner's job."""
    if arm.kind in PEER_KINDS:
        raise ValueError(f"arm {arm.label!r} is built by the training loop on the model itself, under "
                         "torch.distributed (experiments.peer_arms)")
    kwargs = optimizer_kwargs(arm, preset)
    named = list(named_params)
    groups = param_groups(arm, named)
    if arm.kind in ("adamw", ALONE):
        return torch.optim.AdamW(groups, **kwargs)
    if arm.kind == "diloco":  # every coefficient of a chunk: the whole pseudo-gradient
        chunk = default_rule(None, None, kwargs.get("compression_chunk"), kwargs["sync_every"])[2]
        kwargs["compression_topk"] = chunk**2
    if "inner" in runner_options(arm.kind):
        matrices = {id(p) for n, p in named if param_part(n, p) == "matrix"}
        kwargs["inner_optimizer"] = inner_optimizer(arm.options, kwargs.get("sync_every", 1), matrices)
    return _optimizer_class(arm.kind)(groups, comm=backend, **kwargs)


def check_arm(arm: Arm, preset) -> None:
    """Build the arm's optimizer on a dummy parameter, so bad option values fail before any training.
    A peer arm's optimizer needs torch.distributed: its options get the checks its constructor makes."""
    try:
        if arm.kind in PEER_KINDS:
            return check_peer_options(arm.kind, optimizer_kwargs(arm, preset))
        dummies = [("embed.weight", torch.zeros(4, 2)), ("norm.weight", torch.zeros(2)), ("w", torch.zeros(2, 2))]
        opt = build_optimizer(arm, [(n, torch.nn.Parameter(t)) for n, t in dummies], preset, SingleWorkerBackend())
        compression_warmup(arm.options, opt)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Invalid arm {arm.label!r}: {exc}") from None
