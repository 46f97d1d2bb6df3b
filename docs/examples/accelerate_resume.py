"""Exact resume under accelerate:
`accelerate launch --multi_gpu --num_processes 2 docs/examples/accelerate_resume.py`.

Trains 8 steps straight, then 4 steps saved with distro-opt's save_state (accelerate's save_state
plus each rank's DisTrOAdamW state), and 4 more resumed from it with load_state: the resumed run
ends bit-identical to the straight one."""
import shutil
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from distro_opt import DisTrOAdamW
from distro_opt.integrations.accelerate import load_state, save_state, without_ddp


def train(steps, save_to=None, resume_from=None):
    accelerator = without_ddp(Accelerator(cpu=True))
    torch.manual_seed(0)  # the same model on every rank: nothing broadcasts it without DDP
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = DisTrOAdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    done = 0
    if resume_from:
        load_state(accelerator, resume_from, opt)  # refused unless saved by as many ranks as these
        done = 4
        loader = accelerator.skip_first_batches(loader, done)  # the batches the saved run took
    for xb, yb in loader:
        if done == steps:
            break
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        done += 1
    if save_to:
        save_state(accelerator, save_to, opt)  # accelerator.save_state(save_to), and every rank's state
    return accelerator, model


accelerator, straight = train(8)
root = broadcast_object_list([tempfile.mkdtemp(prefix="distro-acc-") if accelerator.is_main_process else None])[0]
train(4, save_to=f"{root}/step4")  # one folder for every rank: on several machines, a shared one
_, resumed = train(8, resume_from=f"{root}/step4")
same = all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
print(f"rank {accelerator.process_index}: resumed run {'equals' if same else 'DIFFERS FROM'} the straight one")
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    shutil.rmtree(root)
accelerator.free_memory()  # the optimizers go before the group (see accelerate_loop.py)
accelerator.end_training()  # destroys the process group before the interpreter exits
