"""Test helper: the volunteer program (``distro_opt.volunteer``) with two knobs only tests need.

    python _hm_peer.py [--step-delay-s S] [--perturb-at-step N] <distro-peer options>

``--step-delay-s``: extra compute time per step, so that a run lasts long enough to kill a peer or
join one mid-run. ``--perturb-at-step``: nudge this peer's parameters after that step, so that the
replica checksum guard must notice the divergence and reload state from the majority. Both reach
the program through ``volunteer.run``'s ``after_step`` hook.
"""

from __future__ import annotations

import sys
import time

import torch

from distro_opt import volunteer


def pop_option(argv: list[str], flag: str, cast, default):
    """Remove ``flag VALUE`` from ``argv`` (in place) and return ``cast(VALUE)``, or ``default``."""
    if flag not in argv:
        return default
    i = argv.index(flag)
    value = cast(argv[i + 1])
    del argv[i : i + 2]
    return value


def after_step(step_delay_s: float, perturb_at_step: int):
    def hook(step, model):
        if step == perturb_at_step:
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
        time.sleep(step_delay_s)

    return hook


def main() -> int:
    argv = sys.argv[1:]
    step_delay_s = pop_option(argv, "--step-delay-s", float, 0.0)
    perturb_at_step = pop_option(argv, "--perturb-at-step", int, -1)
    return volunteer.run(volunteer.parse_args(argv), after_step=after_step(step_delay_s, perturb_at_step))


if __name__ == "__main__":
    sys.exit(main())
