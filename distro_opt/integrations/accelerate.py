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

Checkpoints: ``accelerator.save_state`` saves rank 0's optimizer state alone (``optimizer.bin``) and
``load_state`` loads it on every rank, which would give every rank rank 0's error feedback. Save and
load through ``save_state``/``load_state`` here instead: they call accelerate's and keep each other
rank's DisTrOAdamW state beside it (``optimizers-rank{r}.pt``, ``integrations.rank_states``)::

    save_state(accelerator, "ckpt", opt)      # accelerator.save_state("ckpt"), then every rank's state
    load_state(accelerator, "ckpt", opt)      # refused on every rank alike unless saved by this world
"""
from __future__ import annotations

from distro_opt.optimizer import DecoupledMomentumOptimizer

from . import rank_states

RANK_STATE_NAME = "optimizers"  # optimizers-rank{r}.pt: a list, one state per optimizer given

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


def _distro_optimizers(optimizers) -> list:
    """The DisTrOAdamW/DeMo optimizers among ``optimizers`` (one, or a list; accelerate's wrappers
    unwrapped), in order."""
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    inner = [getattr(opt, "optimizer", opt) for opt in optimizers]
    return [opt for opt in inner if isinstance(opt, DecoupledMomentumOptimizer)]


def save_state(accelerator, output_dir, optimizers, **kwargs) -> str:
    """``accelerator.save_state(output_dir, **kwargs)``, then each rank > 0 saves the state of its
    DisTrOAdamW/DeMo ``optimizers`` beside it (rank 0's is accelerate's ``optimizer.bin``) and rank
    0 the world size. Returns the folder accelerate saved to. ``output_dir`` is required: every rank
    must write to the folder accelerate chose."""
    if output_dir is None:
        raise ValueError("distro-opt: save_state needs output_dir (every rank writes its optimizer state there)")
    location = accelerator.save_state(output_dir, **kwargs)
    location = output_dir if location is None else location
    states = [opt.state_dict() for opt in _distro_optimizers(optimizers)]
    rank_states.save(location, states, accelerator.process_index, accelerator.num_processes, RANK_STATE_NAME)
    accelerator.wait_for_everyone()  # the checkpoint is whole once every rank's file is there
    return location


def load_state(accelerator, input_dir, optimizers, **kwargs) -> None:
    """Check that ``input_dir`` holds the state of every rank of this world (on every rank alike,
    before anything is loaded), ``accelerator.load_state(input_dir, **kwargs)``, then each rank > 0
    loads its own state into its DisTrOAdamW/DeMo ``optimizers`` (the same ones, in the same order,
    as were saved)."""
    if input_dir is None:
        raise ValueError("distro-opt: load_state needs input_dir (the folder save_state wrote)")
    mine = _distro_optimizers(optimizers)
    if mine:
        rank_states.check(input_dir, accelerator.num_processes, RANK_STATE_NAME, "optimizer.bin")
    states = rank_states.load(input_dir, accelerator.process_index, RANK_STATE_NAME) if mine else None
    if states is not None and len(states) != len(mine):
        raise ValueError(f"distro-opt: {input_dir} holds {len(states)} optimizer states for this rank, "
                         f"and load_state was given {len(mine)} DisTrOAdamW/DeMo optimizers")
    accelerator.load_state(input_dir, **kwargs)
    for opt, state in zip(mine, states or []):
        opt.load_state_dict(state)
