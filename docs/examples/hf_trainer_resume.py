"""Exact resume under transformers' Trainer: `torchrun --nproc-per-node 2 docs/examples/hf_trainer_resume.py`.

Trains 8 steps straight, then 8 steps again interrupted after the checkpoint of step 4 and resumed
from it. The checkpoint holds each rank's DisTrOAdamW state (Trainer's optimizer.pt is rank 0's,
optimizer-rank1.pt rank 1's), so the resumed run ends bit-identical to the straight one."""
import shutil
import tempfile

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from distro_opt.integrations.hf import DisTrOTrainer


class StopAfterStep4(TrainerCallback):  # the interruption, right after step 4's checkpoint
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == 4


def train(output_dir, callbacks=(), resume=None):
    torch.manual_seed(0)  # the same model on every rank: nothing broadcasts it without DDP
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, max_steps=8, per_device_train_batch_size=4,
        learning_rate=2e-3, report_to="none", save_strategy="steps", save_steps=4, disable_tqdm=True,
    )
    trainer = DisTrOTrainer(model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
                            callbacks=list(callbacks), distro_kwargs={"compression_topk": 8})
    trainer.train(resume_from_checkpoint=resume)
    return model


state = PartialState(cpu=True)  # starts the process group, as Trainer would
root = broadcast_object_list([tempfile.mkdtemp(prefix="distro-hf-") if state.is_main_process else None])[0]
straight = train(f"{root}/straight")  # one folder for every rank: on several machines, a shared one
train(f"{root}/resumed", callbacks=[StopAfterStep4()])
resumed = train(f"{root}/resumed", resume=f"{root}/resumed/checkpoint-4")
same = all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
print(f"rank {state.process_index}: resumed run {'equals' if same else 'DIFFERS FROM'} the straight one")
state.wait_for_everyone()
if state.is_main_process:
    shutil.rmtree(root)
state.destroy_process_group()  # before the interpreter exits
