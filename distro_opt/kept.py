"""Tensors that outlive an optimizer step.

``step()`` and ``flush()`` run under ``torch.inference_mode()``: the step's ~1,000 small tensor
operations then skip autograd's bookkeeping (2-5% of a CPU step here, see the README). Tensors made
under it are inference tensors, which cannot be updated in place outside inference mode. So what
the optimizer keeps between steps (its state, reused buffers, cached tables) is made inside
``kept_tensors()`` and stays an ordinary tensor, which users may inspect, modify and save as with
any torch optimizer; views of it taken inside the step are ordinary tensors too.
"""
from __future__ import annotations

import torch


def kept_tensors():
    """A context in which new tensors are ordinary ones, also inside the step's inference mode."""
    return torch.inference_mode(False)
