"""Four workers as threads of one process, to try distro-opt before any cluster:
`python docs/examples/plain_loop.py`. Each worker's loop is the one a torchrun rank runs."""
import torch

from distro_opt import DisTrOAdamW
from distro_opt.comm import InProcessBackend


def make_model():
    torch.manual_seed(0)  # the same model for every worker (torch's global RNG is not per thread)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


models = [make_model() for _ in range(4)]


def worker(comm):
    model = models[comm.rank]
    opt = DisTrOAdamW(model.parameters(), lr=1e-3, comm=comm)
    data = torch.Generator().manual_seed(comm.rank)  # each worker its own batches
    for step in range(20):
        x = torch.randn(16, 32, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item(), comm.stats.bytes_sent


results = InProcessBackend.run(4, worker, timeout_s=60)
for rank, (loss, sent) in enumerate(results):
    print(f"worker {rank}: loss {loss:.4f}, {sent} bytes sent")
