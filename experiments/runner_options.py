"""Arm options that are the runner's rather than an optimizer argument: a compression warm-up
(``distro_opt.CompressionWarmup``) and, by name, the local-step mode's inner optimizer.

* ``warmup_for=N,warmup_topk=K,warmup_bits=B`` (distro, demo): the first N steps send top-K in B bits.
* ``inner=adamw|muon`` (distro, diloco; local steps only): the inner optimizer. ``muon`` is
  ``distro_opt.MuonAdamW``, MuLoCo's: Muon on the hidden matrices (the ``matrix`` kind of
  ``arms.param_part``), AdamW on embeddings, head and 1-D parameters, at the arm's lr and weight decay.
"""
from __future__ import annotations

from distro_opt import CompressionWarmup, MuonAdamW

WARMUP_OPTIONS = {"warmup_for": int, "warmup_topk": int, "warmup_bits": int}
INNER_OPTIMIZERS = ("adamw", "muon")
RUNNER_OPTIONS = {**WARMUP_OPTIONS, "inner": str}
_KINDS = {**dict.fromkeys(WARMUP_OPTIONS, ("distro", "demo")), "inner": ("distro", "diloco")}  # who takes each


def runner_options(kind: str) -> set[str]:
    """The runner options an arm of ``kind`` takes."""
    return {name for name, kinds in _KINDS.items() if kind in kinds}


def compression_warmup(options: dict, opt) -> CompressionWarmup | None:
    """The compression warm-up an arm's ``options`` ask for, over ``opt`` (None without ``warmup_for``)."""
    steps = options.get("warmup_for", 0)
    if not steps:
        if {"warmup_topk", "warmup_bits"} & set(options):
            raise ValueError("warmup_topk and warmup_bits need warmup_for (the warm-up's steps)")
        return None
    return CompressionWarmup(opt, steps, options.get("warmup_topk"), options.get("warmup_bits"))


def wants_muon(options: dict) -> bool:
    return options.get("inner", "adamw") == "muon"


def inner_optimizer(options: dict, sync_every: int, matrices: set[int]):
    """The ``inner_optimizer`` factory an arm's ``options`` ask for (None: DisTrOAdamW's own AdamW).
    ``matrices``: the ids of the parameters Muon steps; a group of them only takes Muon."""
    name = options.get("inner", "adamw")
    if name not in INNER_OPTIMIZERS:
        raise ValueError(f"Invalid inner optimizer {name!r} (expected one of {', '.join(INNER_OPTIMIZERS)})")
    if name == "adamw":
        return None
    if sync_every <= 1:
        raise ValueError("inner=muon is the local-step mode's inner optimizer: it needs sync_every (H) > 1")

    def make(groups):
        muon = [i for i, g in enumerate(groups) if g["params"] and all(id(p) in matrices for p in g["params"])]
        return MuonAdamW(groups, muon_groups=muon)

    return make
