"""Importing transformers without torchao's harmless start-up lines.

transformers imports torchao when it is installed (distro-opt's ``test`` extra pins it for the FP8
tests). torchao then logs a failure for each of its compiled CUDA kernels (``torchao/_C*.so``) that
a torch build without CUDA cannot load, and torch logs a deprecation notice for each Enum torchao
registers with ``register_constant``. Neither changes anything distro-opt or the FP8 emulation on
CPUs does. ``quiet_torchao()`` drops exactly those records while the integrations import
transformers; every other line of those loggers, and every line once the import is done, passes.
"""
from __future__ import annotations

import contextlib
import logging
import re

import torch

# torchao/__init__.py: logger.warning(f"Failed to load {file}: {e}") for each _C*.so it tries
_KERNEL_LOAD = re.compile(r"^Failed to load \S*torchao/_C\S*\.so\b")
# torch/utils/_pytree.py: the notice for register_constant() called with an Enum subclass
_ENUM_CONSTANT = re.compile(r"^<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile")


class _Drop(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


@contextlib.contextmanager
def quiet_torchao():
    """While the block runs: torchao's CUDA-kernel load failures (on a torch without CUDA only: with
    CUDA they may be real) and torch's Enum-constant notices are dropped."""
    filters = [("torch.utils._pytree", _Drop(_ENUM_CONSTANT))]
    if torch.version.cuda is None:
        filters.append(("torchao", _Drop(_KERNEL_LOAD)))
    for name, f in filters:
        logging.getLogger(name).addFilter(f)
    try:
        yield
    finally:
        for name, f in filters:
            logging.getLogger(name).removeFilter(f)
