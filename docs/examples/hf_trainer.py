"""transformers' Trainer with DisTrOAdamW: run with `torchrun --nproc-per-node 2 docs/examples/hf_trainer.py`."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from distro_opt.integrations.hf import DisTrOTrainer

torch.manual_seed(0)  # the same model on every rank: nothing broadcasts it without DDP
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0))
tokens = torch.randint(0, 64, (64, 16))
data = [{"input_ids": t, "labels": t} for t in tokens]

args = TrainingArguments(
    output_dir="/tmp/distro-hf", use_cpu=True, max_steps=4, per_device_train_batch_size=4,
    learning_rate=2e-3, report_to="none", save_strategy="no", disable_tqdm=True,
)
trainer = DisTrOTrainer(model=model, args=args, train_dataset=data, distro_kwargs={"compression_topk": 8})
trainer.train()
opt = trainer.optimizer.optimizer  # accelerate wraps the optimizer; this is the DisTrOAdamW
print(f"rank {opt.comm.rank}: {opt.comm.stats.bytes_sent} bytes sent by distro-opt, {opt.payload_nbytes} per step")
trainer.accelerator.end_training()  # destroys the process group before the interpreter exits
