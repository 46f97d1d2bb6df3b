"""DisTrOAdamW beside a DistributedDataParallel model, three ways, and beside FSDP1 (run by
tests/_example_rank.py on 2 ranks). ``PHASES`` holds the distro-opt warnings of each: DDP
all-reducing the gradients (one warning), the same under ``no_sync()`` (none), DDP over a group of
this rank alone, which shares no peer with distro-opt's group (none: the intended hybrid), and FSDP1
reducing the gradients (one warning)."""
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.nn.parallel import DistributedDataParallel

from distro_opt import DisTrOAdamW

dist.init_process_group("gloo")
own_groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates each


def train_and_warn(ddp, steps=2, no_sync=False):
    opt = DisTrOAdamW(ddp.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            x = torch.randn(8, 16, generator=data)
            with ddp.no_sync() if no_sync else torch.enable_grad():
                loss = ddp(x).square().mean()
                opt.zero_grad()
                loss.backward()
            opt.step()
    return [str(w.message) for w in caught if str(w.message).startswith("distro-opt")]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


PHASES = {
    "synced": train_and_warn(DistributedDataParallel(model())),
    "no_sync": train_and_warn(DistributedDataParallel(model()), no_sync=True),
    "own_group": train_and_warn(DistributedDataParallel(model(), process_group=own_groups[dist.get_rank()])),
    "fsdp1": train_and_warn(FullyShardedDataParallel(
        model(), sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"), use_orig_params=True)),
}
dist.destroy_process_group()
