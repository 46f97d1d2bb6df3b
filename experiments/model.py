"""A compact Llama-style decoder: pre-norm RMSNorm, rotary position embeddings, SwiGLU MLP.

Follows the Llama recipe (Touvron et al. 2023, arXiv 2302.13971, Sec. 2.2): RMSNorm before each
sub-layer (Zhang & Sennrich 2019), SwiGLU feed-forward (Shazeer 2020, FFN(x) = W2 (silu(W1 x) * W3 x)),
rotary embeddings on queries and keys (Su et al. 2021, RoFormer), no biases. Sized by ``ModelConfig``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class ModelConfig:
    vocab_size: int = 2048
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 384
    max_seq_len: int = 128
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    activation_checkpointing: bool = False

    def __post_init__(self):
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"Invalid n_heads: {self.n_heads} (d_model {self.d_model} must split into "
                "heads of even size for rotary embeddings)"
            )
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "d_ff", "max_seq_len"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"Invalid {name}: {getattr(self, name)!r}")


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g  (Zhang & Sennrich 2019, Eq. 4)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None):
    """cos/sin of angle m * theta^(-2i/d) for position m and pair i (RoFormer, Eq. 34)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate each (first-half, second-half) pair of ``x`` (batch, heads, seq, head_dim) by its angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = (
            w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)  # up
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        # Not persistent: derived from the config, so checkpoints hold only learned tensors.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """N(0, init_std) everywhere, residual output projections scaled by 1/sqrt(2 * n_layers)
        (GPT-2, Radford et al. 2019, Sec. 2.3) so the residual stream does not grow with depth.
        An explicit generator: the same seed gives the same weights whatever else used torch's RNG."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm gains
                continue
            s = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * s)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (batch, seq, vocab); with ``targets``, the mean next-token cross-entropy instead."""
        if idx.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"Sequence of {idx.shape[1]} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        x = self.embed(idx)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
                # Recompute each block in backward: memory of one block instead of all (Chen et al. 2016).
                x = checkpoint(block, x, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                x = block(x, self.rope_cos, self.rope_sin)
        x = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: ModelConfig, seed: int, device="cpu") -> Transformer:
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.to(device)


def count_parameters(cfg: ModelConfig) -> int:
    """Exact parameter count, from shapes only: the model is built on the meta device (no memory)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())


def parameter_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, in the order an optimizer sees them."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]
