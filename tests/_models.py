"""The small models the tests train, and what the optimizer tests train them on.

The classifier, its batches and its training loop: every draw is seeded (the model by ``seed``
through torch's global RNG, each batch by its own generator from ``rank`` and ``step``), so two
runs that take the same steps end bit-identical, which the tests check with ``torch.equal``. The
experiment runner's smallest transformer is given as the command-line flags that select it."""
import io
import threading

import torch

from distro_opt import DeMo, DisTrOAdamW

OPTIMIZERS = [DisTrOAdamW, DeMo]


_SEEDED_BUILD = threading.Lock()


def make_model(seed=0, width=32):
    """16 inputs -> ``width`` tanh units -> 4 classes, initialised from ``seed``.

    Seeding and building hold one lock: in-process workers are threads sharing torch's global
    generator, and two building at once would draw each other's numbers (replicas that differ)."""
    with _SEEDED_BUILD:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))


def batch(step, rank=0):
    """Worker ``rank``'s 8 inputs and labels of step ``step``: other workers, other data."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(model, opt, steps, rank=0, start=0):
    """Steps ``start`` .. ``start + steps - 1`` of cross-entropy training on worker ``rank``'s batches."""
    for t in range(start, start + steps):
        x, y = batch(t, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def checkpoint_round_trip(model, opt) -> dict:
    """The model's and the optimizer's state ("model", "opt"), through torch.save and torch.load."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf)


# the experiment runner's smallest transformer, as its command-line flags
TINY_TRANSFORMER_FLAGS = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--d-ff", "64"]


def tiny_args(corpus, out, steps=12, extra=()):
    """experiments.run arguments for a seconds-long run of the tiny transformer on the conftest corpus."""
    folder, cache = corpus
    return [
        "--preset",
        "smoke",
        "--arms",
        "adamw,distro",
        "--workers",
        "2",
        "--out",
        str(out),
        "--cache",
        str(cache),
        "--corpus",
        str(folder),
        "--tokenizer",
        "byte",
        *TINY_TRANSFORMER_FLAGS,
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--steps",
        str(steps),
        "--warmup-steps",
        "2",
        "--eval-every",
        "4",
        "--eval-batches",
        "2",
        "--eval-batch-size",
        "4",
        "--checkpoint-every",
        "4",
        "--no-progress",
        "--no-plots",
        "--timeout-s",
        "60",
        *extra,
    ]
