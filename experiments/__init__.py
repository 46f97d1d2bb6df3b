"""Experiments for distro-opt: data, model, runner, byte calculator, plots.

Run from the repository root as ``python -m experiments.<name>``; installed as ``distro_opt.experiments``.
Modules here import each other relatively so both names work.
"""
