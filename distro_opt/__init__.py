"""distro-opt: optimizers that exchange a compressed momentum instead of all-reducing gradients.

``DisTrOAdamW`` is a drop-in for ``torch.optim.AdamW``; ``DeMo`` is a drop-in for the reference DeMo.
Communication backends live in ``distro_opt.comm``.
"""
from .adamw import DisTrOAdamW
from .wire import PayloadLayout, param_spec
from .demo import DeMo
from .values import PayloadError
from .transform import DCTTransform
from .warmup import CompressionWarmup
from .muon import MuonAdamW

__all__ = ["DisTrOAdamW", "DeMo", "CompressionWarmup", "MuonAdamW", "DCTTransform", "PayloadLayout", "PayloadError", "param_spec"]
__version__ = "0.1.0"
