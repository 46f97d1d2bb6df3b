"""Data-parallel wrappers (DDP, FSDP1) that all-reduce the gradients distro-opt already exchanges.

A model wrapped in ``DistributedDataParallel`` all-reduces every dense gradient during backward; if
DisTrOAdamW then exchanges compressed momentum among the same ranks, each step pays for both (and
the compression saves nothing). Trainers wrap models themselves (transformers' Trainer, accelerate),
so this happens without the user writing ``DistributedDataParallel``.

The optimizer sees only parameters, and DDP's reducer keeps its gradient hooks in C++ where Python
cannot list them. So at the first step that communicates the optimizer looks for the wrappers among
the live objects (``gc.get_objects``, once per optimizer) and asks each one holding its parameters
whether its last forward armed a gradient all-reduce: DDP's ``require_forward_param_sync``, which its
forward sets outside ``no_sync()`` and clears inside it; FSDP1's ``_sync_gradients``, cleared by its
``no_sync()``. A wrapper whose group shares no other rank with distro-opt's (DDP inside a node,
distro-opt between nodes) is the intended hybrid and is left alone.

FSDP1 restores ``_sync_gradients`` when its ``no_sync()`` block ends, so a backward run inside that
block and a step taken after it still reads as reducing (a warning it did not need); DDP's flag
lasts until the next forward and has no such gap.
"""
from __future__ import annotations

import gc

import torch.distributed as dist


def _wrapper_types():
    types = []
    if dist.is_available():
        from torch.nn.parallel import DistributedDataParallel

        types.append(DistributedDataParallel)
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel

            types.append(FullyShardedDataParallel)
        except ImportError:  # a torch build without FSDP1
            pass
    return tuple(types)


def _syncs_gradients(wrapper) -> bool:
    if hasattr(wrapper, "require_forward_param_sync"):  # DDP
        return bool(wrapper.require_forward_param_sync)
    return bool(getattr(wrapper, "_sync_gradients", True))  # FSDP1


def _group_ranks(group) -> set[int]:
    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _shares_peers(wrapper, comm) -> bool:
    """Whether the wrapper reduces gradients with a rank distro-opt also exchanges with. ``comm``'s
    ranks are known for a torch.distributed backend (its ``group``); any other backend is assumed to
    share them."""
    if not dist.is_initialized():
        return False
    wrapper_ranks = set()
    for name in ("process_group", "_inter_node_pg"):  # FSDP1's hybrid sharding has both
        group = getattr(wrapper, name, None)
        if group is not None:
            wrapper_ranks |= _group_ranks(group)
    if not hasattr(comm, "group"):
        return len(wrapper_ranks) > 1
    shared = wrapper_ranks & _group_ranks(comm.group)
    return len(shared - {dist.get_rank()}) > 0


def gradient_syncing_wrappers(params, comm) -> list[str]:
    """The class names of the live DDP/FSDP1 wrappers that hold any of ``params`` and all-reduce their
    gradients among ranks that ``comm`` also exchanges with."""
    types = _wrapper_types()
    if not types:
        return []
    ours = {id(p) for p in params}
    found = []
    for obj in gc.get_objects():
        if not issubclass(type(obj), types):  # type(), not isinstance: never runs an object's code
            continue
        if _syncs_gradients(obj) and any(id(p) in ours for p in obj.parameters()) and _shares_peers(obj, comm):
            found.append(type(obj).__name__)
    return sorted(set(found))


def warning_text(wrappers: list[str], optimizer: str) -> str:
    names = " and ".join(wrappers)
    return (
        f"distro-opt: the model is wrapped in {names}, which all-reduces every dense gradient among "
        f"ranks that {optimizer} also exchanges compressed momentum with: each step pays for both, and "
        "the compression saves nothing. Leave the model unwrapped, or run forward and backward under "
        "model.no_sync(); with transformers' Trainer use distro_opt.integrations.hf.DisTrOTrainer, with "
        "accelerate distro_opt.integrations.accelerate.without_ddp (docs/integrations.md)."
    )
