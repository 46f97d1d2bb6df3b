"""DeMo: Decoupled Momentum Optimization (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870)."""
from __future__ import annotations

from .optimizer import DecoupledMomentumOptimizer
from .settings import check_hyperparameters
from .updates import SignUpdate


class DeMo(DecoupledMomentumOptimizer):
    """A drop-in for the public reference DeMo optimizer, with a compact wire format.

    Per step and parameter (Algorithm 1 of the paper): ``p *= 1 - lr * wd``;
    ``Delta = compression_decay * Delta + lr * g``; chunked DCT-II; top-``compression_topk`` per chunk;
    ``Delta -= sent``; all-gather; per-coefficient mean over the workers that kept it; ``p -= lr * sign(IDCT(.))``.

    Differences from the reference that do not change the arithmetic of float32 and float64
    parameters in one param group: one collective per step for all parameters; indices bit-packed
    (12 bits for 64x64 chunks instead of int64); values in ``compression_bits`` (32 = float32 as the
    reference sends for float32 parameters; 64 for float64 ones, which the default 32 rounds to
    float32; 16/8/2/1 compress further); the buffer lives in ``self.state`` (saved by
    ``state_dict``); hyperparameters live in ``param_groups``; parameters of any rank. After a step
    ``p.grad`` still holds the gradient (the reference leaves the sign step there); bytes are counted
    by ``self.comm.stats``, not ``data_transmit``/``data_receive``.

    Differences that do change it, each torch's convention where the reference departs from it:

    * A group's ``weight_decay`` replaces the constructor's, as in every torch optimizer. The reference
      applies the constructor's to every group and adds a group's own on top as SGD's L2 term, so a
      group given ``weight_decay=0.0`` there still decays.
    * bf16 and float16 parameters keep their momentum and transform in float32 (the reference works in
      the parameter's dtype, where ``compression_decay=0.999`` rounds to 1 in bf16).

    Args:
        params: iterable of parameters or param groups.
        lr: learning rate (the sign step's size, and the momentum input scale as in the reference).
        compression_decay: decay of the error-feedback momentum (beta in the paper).
        compression_topk: coefficients kept per chunk.
        compression_chunk: target chunk size per dimension (largest divisor <= it is used).
        weight_decay: decoupled weight decay.
        comm: a ``distro_opt.comm.Backend`` or a torch.distributed ProcessGroup; None = default group.
        process_group: alias of ``comm`` for a ProcessGroup, as in the reference.
        compression_bits: bits per transmitted value (64, 32, 16, 8, 2, 1).
        overlap: apply each step's update one step late, so the collective overlaps the next step.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
        comm=None,
        process_group=None,
        *,
        compression_bits: int = 32,
        overlap: bool = False,
    ):
        check_hyperparameters(lr, weight_decay, compression_decay, compression_topk, compression_chunk, compression_bits)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            compression_decay=compression_decay,
            compression_topk=compression_topk,
            compression_chunk=compression_chunk,
            compression_bits=compression_bits,
        )
        super().__init__(params, defaults, comm=comm, process_group=process_group, overlap=overlap)
        self._sign = SignUpdate(self._weight_decay)

    def _momentum_scale(self, group):
        return group["lr"]

    def _update_rule(self, group):
        return self._sign
