"""What a volunteer trains: a model, the batches of its shard, and the loss. Every peer of a run
must build the same task (same preset, same seed), so that their replicas start identical.

``synthetic`` needs no data. A language preset is one of ``distro_opt.experiments.presets``; it is
the only part of the program that needs the experiment runner, which is imported here, lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SYNTHETIC = "synthetic"


@dataclass
class SyntheticTask:
    """Regression onto a fixed random 2-layer teacher: y = w2 . tanh(W1 x)."""

    in_dim: int = 16
    hidden: int = 48  # not a power of two: index fields can hold out-of-range values, which receivers reject
    batch_size: int = 64
    seed: int = 0

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)  # identical initial replicas on every peer that starts the run
        return nn.Sequential(
            nn.Linear(self.in_dim, self.hidden),
            nn.Tanh(),
            nn.Linear(self.hidden, self.hidden),
            nn.Tanh(),
            nn.Linear(self.hidden, 1),
        )

    def batch(self, shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        teacher = torch.Generator().manual_seed(10_000 + self.seed)
        w1 = torch.randn(self.in_dim, 32, generator=teacher) / self.in_dim**0.5
        w2 = torch.randn(32, 1, generator=teacher) / 32**0.5
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + shard * 7919 + step) & 0x7FFFFFFF)
        x = torch.randn(self.batch_size, self.in_dim, generator=g)
        return x, torch.tanh(x @ w1) @ w2

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)


@dataclass
class LanguageTask:
    """Next-token prediction with an ``experiments.presets`` model on its cached corpus (prepare it
    first with ``python -m experiments.prepare``); shard ``i`` of ``num_shards`` reads its own slice."""

    preset: str = "smoke"
    num_shards: int = 8
    seed: int = 0

    def __post_init__(self):
        from distro_opt.experiments.data import load_corpus
        from distro_opt.experiments.presets import get_preset

        self.cfg = get_preset(self.preset)
        self.corpus = load_corpus(self.cfg.corpus, self.cfg.tokenizer, self.cfg.vocab_size)

    def check_fits(self) -> None:
        """Refuse (``CorpusError``) a shard too small for one window now, not at step 0."""
        from distro_opt.experiments.data import check_corpus_fits

        cfg = self.cfg
        check_corpus_fits(self.corpus, seq_len=cfg.seq_len, workers=self.num_shards, sharding="contiguous")

    def model(self) -> nn.Module:
        from distro_opt.experiments.model import build_model

        return build_model(self.cfg.model_config(self.corpus.vocab_size), seed=self.seed)

    def batch(self, shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        from distro_opt.experiments.data import worker_batch

        return worker_batch(
            self.corpus.train,
            step=step,
            rank=shard % self.num_shards,
            world_size=self.num_shards,
            batch_size=self.cfg.batch_size,
            seq_len=self.cfg.seq_len,
            seed=self.seed,
        )

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model(x, y)


def language_presets() -> list[str]:
    """The names ``--preset`` takes besides ``synthetic``."""
    from distro_opt.experiments.presets import PRESETS

    return list(PRESETS)


def task_errors() -> tuple:
    """What building a task raises for a preset whose corpus is missing or too small."""
    from distro_opt.experiments.data import CorpusError

    return (CorpusError,)


def make_task(preset: str, num_shards: int, seed: int):
    """The task of ``preset`` (a language preset loads its corpus here: ``CorpusError`` if missing)."""
    if preset == SYNTHETIC:
        return SyntheticTask(seed=seed)
    return LanguageTask(preset, num_shards=num_shards, seed=seed)
