"""accelerate without DDP: `accelerate launch --multi_gpu --num_processes 2 docs/examples/accelerate_loop.py`
(or torchrun). On CPUs too: --multi_gpu picks accelerate's multi-process launcher, where --cpu
would start one process whatever --num_processes says."""
import torch
from accelerate import Accelerator

from distro_opt import DisTrOAdamW
from distro_opt.integrations.accelerate import without_ddp

accelerator = without_ddp(Accelerator(cpu=True))  # cpu=True for this example; drop it on GPUs
torch.manual_seed(0)  # the same model on every rank: nothing broadcasts it without DDP
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = DisTrOAdamW(model.parameters(), lr=1e-3)
x = torch.randn(256, 32, generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
model, opt, loader = accelerator.prepare(model, opt, loader)  # each rank gets its share of the batches
for xb, yb in loader:
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    opt.zero_grad()
    accelerator.backward(loss)
    opt.step()
print(f"rank {accelerator.process_index}: loss {loss.item():.4f}, "
      f"{opt.optimizer.comm.stats.bytes_sent} bytes sent")  # opt.optimizer: accelerate's wrapper's
# release the optimizer before the group goes (free_memory also runs the garbage collector): an
# optimizer still alive when the process group is destroyed sometimes aborted the exit in Gloo
model, opt, loader = accelerator.free_memory(model, opt, loader)
accelerator.end_training()  # destroys the process group before the interpreter exits
