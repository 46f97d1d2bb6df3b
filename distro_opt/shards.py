"""Sharded parameters (DTensor, as FSDP2's ``fully_shard`` makes them): the step works on each rank's
local shard.

Inside a node a model may be sharded (FSDP2 over the mesh's shard dimension); between nodes the
optimizer exchanges payloads over the group it is given (the mesh's replicate dimension). Every rank
of that group holds the same shard of each parameter, so chunking, top-k and the payload are per
local shard, and replicas of one shard stay identical. The state is kept as torch's optimizers keep
it for DTensor parameters: each parameter-shaped state tensor is a DTensor with the parameter's mesh
and placements (torch.distributed.checkpoint saves and reshards those), whose local tensor is what
the step reads and writes. Plain tensors pass through untouched.
"""
from __future__ import annotations

import math

import torch

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch without torch.distributed
    DTensor = Shard = None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor (asked several times per parameter and step: the type test first,
    which answers for plain tensors without ``isinstance``'s slower walk)."""
    return type(t) not in _PLAIN and DTensor is not None and isinstance(t, DTensor)


def local(t):
    """A DTensor's local shard (the tensor itself, so in-place updates reach the DTensor); anything
    else as it is."""
    return t._local_tensor if is_sharded(t) else t


def like_param(value: torch.Tensor, p) -> torch.Tensor:
    """``value`` (of ``p``'s local shape) as a DTensor laid out like ``p``; itself for a plain ``p``."""
    if not is_sharded(p):
        return value
    with torch.inference_mode(False):  # state outlives the step: an ordinary tensor (see optimizer.py)
        return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def saveable(state: dict) -> dict:
    """``state`` (one parameter's, as ``state_dict`` packs it) with each DTensor whose local shard is
    a view into a larger buffer (the momentum stacks of ``momentum.py``) replaced by one over a copy
    of it: torch.save cannot serialize a DTensor over a view at an offset. ``state`` itself is left
    as it is; one without such a DTensor is returned as it is."""
    def offset(v):
        return is_sharded(v) and v._local_tensor.storage_offset() != 0

    if not any(offset(v) for v in state.values()):
        return state
    return {k: like_param(v._local_tensor.clone(), v) if offset(v) else v for k, v in state.items()}


def _replica_layout(p):
    """(root mesh, its placements for a per-replica tensor, number of replicas) when ``p``'s mesh is
    one dimension of a larger mesh whose other dimension holds the replicas (a mesh's "shard"
    dimension, as in ``mesh["shard"]``); None otherwise."""
    mesh = p.device_mesh
    root = mesh._get_root_mesh()
    names, root_names = mesh.mesh_dim_names or (), root.mesh_dim_names or ()
    if root is mesh or root.ndim != mesh.ndim + 1 or not set(names) <= set(root_names):
        return None
    placements = []
    for name in root_names:
        if name not in names:
            placements.append(Shard(0))  # the replicas, stacked along a new first dimension
            replicas = root.size(root_names.index(name))
            continue
        placement = p.placements[names.index(name)]
        placements.append(Shard(placement.dim + 1) if isinstance(placement, Shard) else placement)
    return root, tuple(placements), replicas


def per_replica(value, p):
    """A state tensor that differs between replicas (the error-feedback momentum: each worker keeps
    what it did not send), laid out so that torch.distributed.checkpoint keeps every replica's copy:
    a DTensor over ``p``'s whole mesh of shape (replicas, *p.shape), replica r's shard in row r. A
    DTensor laid out like ``p`` alone reads to DCP as one tensor held by every replica, and it keeps
    one copy. ``value`` itself where ``p``'s mesh has no replica dimension, or is not a DTensor."""
    layout = _replica_layout(p) if is_sharded(p) and is_sharded(value) else None
    if layout is None:
        return value
    root, placements, replicas = layout
    shape = (replicas, *p.shape)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    with torch.inference_mode(False):
        return DTensor.from_local(value._local_tensor.unsqueeze(0).clone(), root, placements, run_check=False,
                                  shape=torch.Size(shape), stride=stride)


def from_per_replica(value, p):
    """Inverse of ``per_replica``: this rank's row laid out like ``p`` (anything else as it is)."""
    if not (is_sharded(p) and is_sharded(value)) or value.dim() != p.dim() + 1:
        return value
    return like_param(value._local_tensor.squeeze(0).clone(), p)


class LocalStates:
    """Each entry's state as the step reads and writes it: the optimizer's own ``state[p]`` dict for a
    plain parameter; for a DTensor one, a dict of the local tensors, whose new or replaced entries
    ``write_back`` stores as DTensors laid out like the parameter."""

    def __init__(self, opt_state, params):
        self._opt_state, self._params = opt_state, params
        self.any_sharded = any(map(is_sharded, params))
        self.dicts = [
            {k: local(v) for k, v in opt_state[p].items()} if self.any_sharded and is_sharded(p) else opt_state[p]
            for p in params
        ]

    def write_back(self) -> None:
        if not self.any_sharded:
            return
        for p, work in zip(self._params, self.dicts):
            if not is_sharded(p):
                continue
            state = self._opt_state[p]
            shape = p._local_tensor.shape
            for key, value in work.items():
                if key in state and local(state[key]) is value:
                    continue
                param_shaped = torch.is_tensor(value) and value.dim() > 0 and value.shape == shape
                state[key] = like_param(value, p) if param_shaped else value
