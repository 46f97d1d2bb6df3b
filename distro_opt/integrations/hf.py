"""transformers' Trainer with DisTrOAdamW doing the only gradient communication.

    from distro_opt.integrations.hf import DisTrOTrainer

    trainer = DisTrOTrainer(model=model, args=args, train_dataset=data,
                            distro_kwargs={"compression_topk": 4})   # run it under torchrun
    trainer.train()

``DisTrOTrainer`` is a ``transformers.Trainer`` whose accelerator never wraps the model in
DistributedDataParallel (``integrations.accelerate.without_ddp``): a plain Trainer would all-reduce
every dense gradient and DisTrOAdamW would then exchange its payload as well, paying for both. With
no ``optimizers=`` or ``optimizer_cls_and_kwargs=`` it builds DisTrOAdamW from the arguments'
learning rate, Adam betas and epsilon, and Trainer's weight-decay groups, plus ``distro_kwargs``;
either argument still chooses the optimizer as with Trainer. The optimizer's ``comm=None`` is
resolved at its first step, so it uses the process group Trainer starts, even when it was built
before the Trainer.

Checkpoints keep every rank's optimizer state: Trainer saves rank 0's as ``optimizer.pt`` and
loads it on every rank, which would give each rank rank 0's error feedback; ``DisTrOTrainer`` saves
each other rank's beside it (``optimizer-rank{r}.pt``, ``integrations.rank_states``) and loads it
there after Trainer's load, so a resumed run continues exactly as the uninterrupted one. A checkpoint
saved by another number of ranks, or without the per-rank files, is refused on every rank before
anything is loaded. Every rank writes into the checkpoint folder: on several machines it must be on
a shared filesystem.

Without DDP nothing broadcasts rank 0's parameters when training starts: build the model alike on
every rank (``from_pretrained``, or the same seed); DisTrOAdamW compares the replicas at its first
step and refuses ones that differ. Trainer's FSDP and DeepSpeed set-ups are refused (they reduce
gradients themselves; see docs/integrations.md for FSDP2).
"""
from __future__ import annotations

import os

from distro_opt.integrations.quiet_import import quiet_torchao

with quiet_torchao():  # transformers imports torchao when it is installed
    from transformers import Trainer
    from transformers.trainer import OPTIMIZER_NAME

from distro_opt.adamw import DisTrOAdamW
from distro_opt.optimizer import DecoupledMomentumOptimizer

from . import rank_states
from .accelerate import without_ddp

RANK_STATE_NAME = "optimizer"  # optimizer-rank{r}.pt, beside Trainer's optimizer.pt (rank 0's)


class DisTrOTrainer(Trainer):
    """``transformers.Trainer`` without DDP's gradient all-reduce, DisTrOAdamW by default (see the
    module docstring). ``distro_kwargs``: DisTrOAdamW's own settings (``compression_topk``, ...)."""

    def __init__(self, *args, distro_kwargs: dict | None = None, **kwargs):
        self.distro_kwargs = dict(distro_kwargs or {})
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        without_ddp(self.accelerator)

    def create_optimizer(self, model=None):
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            args = self.args
            settings = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                        "eps": args.adam_epsilon}
            self.optimizer_cls_and_kwargs = (DisTrOAdamW, {**settings, **self.distro_kwargs})
        return super().create_optimizer(model)

    def _distro_optimizer(self):
        """The optimizer whose state is per rank (accelerate wraps it), or None for another kind."""
        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        return opt if isinstance(opt, DecoupledMomentumOptimizer) else None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        opt = self._distro_optimizer()
        if opt is not None:
            rank, world = self.args.process_index, self.args.world_size
            rank_states.save(output_dir, opt.state_dict() if rank > 0 else None, rank, world, RANK_STATE_NAME)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opt = self._distro_optimizer() if checkpoint is not None else None
        if opt is not None and os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            rank_states.check(checkpoint, self.args.world_size, RANK_STATE_NAME, OPTIMIZER_NAME)
        super()._load_optimizer_and_scheduler(checkpoint)  # rank 0's state, on every rank
        if opt is not None and os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            own = rank_states.load(checkpoint, self.args.process_index, RANK_STATE_NAME)
            if own is not None:
                opt.load_state_dict(own)
