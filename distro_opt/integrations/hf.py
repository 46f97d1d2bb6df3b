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

Without DDP nothing broadcasts rank 0's parameters when training starts: build the model alike on
every rank (``from_pretrained``, or the same seed); DisTrOAdamW compares the replicas at its first
step and refuses ones that differ. Trainer's FSDP and DeepSpeed set-ups are refused (they reduce
gradients themselves; see docs/integrations.md for FSDP2).
"""
from __future__ import annotations

from transformers import Trainer

from distro_opt.adamw import DisTrOAdamW

from .accelerate import without_ddp


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
