"""Test-only, run as an example on 2 ranks (tests/_example_rank.py): a DisTrOTrainer checkpoint
(2 steps, saved at step 2) and an accelerate one (distro-opt's save_state after 2 steps), written
into $DISTRO_TEST_CHECKPOINTS/trainer and /accelerate, for the tests that resume them elsewhere."""
import os

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from distro_opt import DisTrOAdamW
from distro_opt.integrations.accelerate import save_state, without_ddp
from distro_opt.integrations.hf import DisTrOTrainer

def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def trainer_args(output_dir, max_steps):
    return TrainingArguments(output_dir=output_dir, use_cpu=True, max_steps=max_steps, per_device_train_batch_size=4,
                             learning_rate=2e-3, report_to="none", save_strategy="steps", save_steps=2,
                             disable_tqdm=True)


def tokens():
    t = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in t]


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


if __name__ == "__main__":
    ROOT = os.environ["DISTRO_TEST_CHECKPOINTS"]
    DisTrOTrainer(model=tiny_gpt2(), args=trainer_args(f"{ROOT}/trainer", 2), train_dataset=tokens()).train()
    accelerator = without_ddp(Accelerator(cpu=True))
    model = small_model()
    model, opt = accelerator.prepare(model, DisTrOAdamW(model.parameters(), lr=1e-3))
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + accelerator.process_index))
        opt.zero_grad()
        accelerator.backward(model(x).pow(2).mean())
        opt.step()
    save_state(accelerator, f"{ROOT}/accelerate", opt)
