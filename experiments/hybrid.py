"""Hybrid runs: the model sharded inside a node (FSDP2), distro-opt only between nodes.

With world size W and shard degree S the ranks form a 2-D ``init_device_mesh`` of shape (W/S, S),
dimensions ("replicate", "shard"): consecutive ranks (one node's GPUs under torchrun) hold the
shards of one replica. ``fully_shard`` over the shard dimension, per block and at the root as FSDP2
is normally used, keeps its all-gathers and reduce-scatters inside the node; the optimizer (or the
AdamW arm's gradient all-reduce) talks over the replicate dimension only, and only those bytes are
counted. Each replica is one worker of the run: the ranks of one shard group train on the same batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


def check_shard_degree(world_size: int, shard_degree: int) -> None:
    """A one-line ``ValueError`` unless ``shard_degree`` splits ``world_size`` into whole replicas."""
    if not shard_degree >= 1:
        raise ValueError(f"Invalid shard_degree: {shard_degree!r} (expected >= 1)")
    if world_size % shard_degree != 0:
        raise ValueError(
            f"Invalid shard_degree: {shard_degree} does not divide the world size {world_size} "
            "(every replica needs shard_degree ranks)"
        )


@dataclass
class HybridMesh:
    """The (replicate, shard) mesh of this rank, and where the rank sits in it."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    replicas: int
    shard_degree: int

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        """The inter-node group: one rank per replica, all holding the same shard."""
        return self.mesh["replicate"].get_group()

    @property
    def rank(self) -> int:
        """This process's rank in the whole mesh (the default group's)."""
        return self.mesh.get_rank()

    @property
    def world_size(self) -> int:
        return self.replicas * self.shard_degree


def hybrid_mesh(device_type: str, shard_degree: int) -> HybridMesh:
    """The mesh over the default process group's ranks (which must exist)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    check_shard_degree(world, shard_degree)
    replicas = world // shard_degree
    mesh = init_device_mesh(device_type, (replicas, shard_degree), mesh_dim_names=("replicate", "shard"))
    return HybridMesh(mesh=mesh, replicas=replicas, shard_degree=shard_degree)


def shard_model(model, blocks, hybrid: HybridMesh):
    """``fully_shard`` each of ``blocks`` (the modules gathered one at a time), then ``model`` itself
    (the rest: embeddings, final norm, head), over the mesh's shard dimension. In place; returns
    ``model``."""
    from torch.distributed.fsdp import fully_shard

    shard_mesh = hybrid.mesh["shard"]
    for block in blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model
