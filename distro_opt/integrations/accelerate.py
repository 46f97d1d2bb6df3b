"""accelerate without DistributedDataParallel: ``accelerator.prepare`` keeps its device placement,
mixed precision, data loaders and schedulers, but leaves the model unwrapped, so that DisTrOAdamW's
compressed exchange is the only gradient communication.

    from accelerate import Accelerator
    from distro_opt.integrations.accelerate import without_ddp

    accelerator = without_ddp(Accelerator())
    model, opt, loader = accelerator.prepare(model, DisTrOAdamW(model.parameters()), loader)

accelerate wraps a model in DDP in ``Accelerator.prepare_model`` unless it is asked for an
evaluation-only model (``evaluation_mode=True``: placement, autocast and compilation, no wrapper);
``without_ddp`` makes every model this accelerator prepares be prepared that way. Gradient
accumulation works as before (``accelerator.accumulate``: the optimizer steps on sync steps only);
``no_sync`` has nothing left to turn off. Without DDP nothing broadcasts rank 0's parameters at
``prepare``: build the model alike on every rank (the same seed or checkpoint); DisTrOAdamW compares
the replicas at its first step and refuses ones that differ.
"""
from __future__ import annotations

# accelerate's distributed types whose wrapper is DDP (other types shard or hand the model to an
# engine that communicates itself: those are refused rather than silently left doing both)
DDP_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_NPU",
             "MULTI_HPU", "MULTI_SDAA", "MULTI_NEURON")


def without_ddp(accelerator):
    """``accelerator``, changed so that ``prepare``/``prepare_model`` never wrap a model in
    DistributedDataParallel. Refuses a set-up whose wrapper is not DDP (FSDP, DeepSpeed, Megatron,
    XLA): shard with FSDP2 directly instead (docs/torch-distributed.md, "Sharded models")."""
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in DDP_TYPES:
        raise ValueError(
            f"distro-opt: accelerate is set up for {kind}, which reduces gradients itself; distro-opt "
            "replaces DDP's all-reduce only. For sharded models use FSDP2's fully_shard over one "
            "mesh dimension and DisTrOAdamW over the other (docs/torch-distributed.md)."
        )
    prepare_model = accelerator.prepare_model  # the bound method of accelerate's class

    def prepare_model_without_ddp(model, device_placement=None, evaluation_mode=False):
        return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    accelerator.prepare_model = prepare_model_without_ddp  # Accelerator.prepare calls self.prepare_model
    return accelerator
