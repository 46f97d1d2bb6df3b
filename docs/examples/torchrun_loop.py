"""A plain training loop on several processes: `torchrun --nproc-per-node 2 docs/examples/torchrun_loop.py`."""
import gc

import torch
import torch.distributed as dist

from distro_opt import DisTrOAdamW

dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR ("nccl" for CUDA)
torch.manual_seed(0)  # the same model on every rank: DisTrOAdamW compares them at its first step
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = DisTrOAdamW(model.parameters(), lr=1e-3)  # comm=None: the default group; and no DDP wrapper
data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
for step in range(20):
    x = torch.randn(16, 32, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"rank {dist.get_rank()}: loss {loss.item():.4f}, {opt.comm.stats.bytes_sent} bytes sent")
# release the optimizer and collect before the group goes: an optimizer still alive when the
# process group is destroyed sometimes aborted the exit in Gloo ("terminate called ...")
del opt
gc.collect()
dist.destroy_process_group()
