"""distro-opt inside the training tools people already use: transformers' Trainer (``hf``) and
accelerate (``accelerate``). Each keeps the tool's DistributedDataParallel wrapper out, so that
DisTrOAdamW's compressed exchange is the only gradient communication, and lets the optimizer find
the process group the tool starts (``comm=None`` is resolved at the first step).

transformers and accelerate are optional (the ``hf`` extra): importing ``distro_opt`` does not
import them, only ``distro_opt.integrations.hf`` or ``.accelerate`` does. Recipes for plain loops,
torchrun, both tools and FSDP2: docs/integrations.md.
"""
