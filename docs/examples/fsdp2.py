"""FSDP2 inside a node, DisTrOAdamW between nodes: `torchrun --nproc-per-node 4 docs/examples/fsdp2.py`
makes a 2 x 2 mesh on one machine; on a cluster use (nodes, gpus_per_node) and "cuda"."""
import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distro_opt import DisTrOAdamW

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
torch.manual_seed(0)  # the same model on every rank
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh["shard"])
fully_shard(model, mesh=mesh["shard"])
opt = DisTrOAdamW(model.parameters(), lr=1e-3, comm=mesh["replicate"].get_group())
data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
for step in range(10):
    x = torch.randn(8, 64, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), x)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"rank {dist.get_rank()}: loss {loss.item():.4f}, {opt.comm.stats.bytes_sent} bytes sent")
# release the optimizer and collect before the group goes: an optimizer still alive when the
# process group is destroyed sometimes aborted the exit in Gloo ("terminate called ...")
del opt
gc.collect()
dist.destroy_process_group()
