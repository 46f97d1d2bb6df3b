"""The walk of one optimizer step through the package: which files and functions it enters, in order.

One ``DisTrOAdamW`` step (defaults, one worker, after two warm-up steps so that every cache is
built) of a small transformer's shapes is traced with ``sys.setprofile``. Printed: the package's
files in the order the step first enters them, how many times the walk comes back to a file it
had left for another one, and how many distinct functions it calls. Frames of torch and the
standard library are not counted; the communication backend (``distro_opt.comm``) is, as a file.

    python benchmarks/walk_step.py [--update sign|rms|adam] [--functions]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import distro_opt
from distro_opt import DisTrOAdamW
from distro_opt.comm import SingleWorkerBackend

ROOTS = [os.path.dirname(distro_opt.__file__), os.path.dirname(sys.modules["distro_opt.comm"].__file__)]
SHAPES = [(512, 128), (128,), (128, 128), (128, 128), (512, 128), (128, 512)]


def _package_file(path: str) -> str | None:
    for root in ROOTS:
        if path.startswith(root + os.sep):
            name = os.path.relpath(path, os.path.dirname(root))
            return name.replace(os.sep, "/")
    return None


def walk(update: str = "sign"):
    """(files in order of first entry, returns to a file left before, functions called)."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = DisTrOAdamW(params, lr=1e-3, update=update, comm=SingleWorkerBackend())
    for _ in range(2):  # warm-up: every cache is built
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
    for p in params:
        p.grad = torch.randn(p.shape)
    files, functions, returns, current = [], set(), 0, [None]

    def profile(frame, event, arg):
        nonlocal returns
        if event != "call":
            return
        name = _package_file(frame.f_code.co_filename)
        if name is None:
            return
        functions.add(f"{name}:{frame.f_code.co_name}")
        if name != current[0]:
            if name in files:
                returns += 1
            else:
                files.append(name)
            current[0] = name

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return files, returns, sorted(functions)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", choices=("sign", "rms", "adam"), default="sign")
    parser.add_argument("--functions", action="store_true", help="also list every function called")
    args = parser.parse_args(argv)
    files, returns, functions = walk(args.update)
    print(f"files entered: {len(files)} (after optimizer.py: {len(files) - 1}); "
          f"returns to a file already left: {returns}; functions: {len(functions)}")
    print(" -> ".join(files))
    if args.functions:
        print("\n".join(functions))


if __name__ == "__main__":
    main()
