"""The Llama-style decoder and the presets' sizes."""

import dataclasses

import pytest
import torch

from distro_opt.experiments.model import ModelConfig, Transformer, build_model, count_parameters
from distro_opt.experiments.presets import get_preset

TINY = ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=2, d_ff=64, max_seq_len=16)


def test_llama_1_2b_preset_has_the_distro_report_size_on_the_meta_device():
    cfg = get_preset("llama-1.2b").model_config()
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.vocab_size, cfg.max_seq_len) == (
        16,
        2048,
        8192,
        8,
        32000,
        2048,
    )
    # 16 x (4 x 2048^2 + 3 x 2048 x 8192 + 2 x 2048) + 2 x 32000 x 2048 + 2048
    assert count_parameters(cfg) == 1_204_881_408


def test_smoke_preset_is_about_one_million_parameters():
    assert count_parameters(get_preset("smoke").model_config()) == 1_115_264


def test_untied_embeddings_add_one_vocab_by_width_matrix():
    untied = dataclasses.replace(TINY, tie_embeddings=False)
    assert count_parameters(untied) - count_parameters(TINY) == 64 * 32


def test_decoder_is_causal():
    model = build_model(TINY, seed=0).eval()
    x = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 64
    with torch.no_grad():
        assert torch.allclose(model(x)[0, :8], model(y)[0, :8], atol=1e-6)
        assert not torch.allclose(model(x)[0, 8:], model(y)[0, 8:], atol=1e-3)


def test_same_seed_gives_same_weights_whatever_the_global_rng():
    a = build_model(TINY, seed=3)
    torch.manual_seed(123)
    torch.rand(10)
    b = build_model(TINY, seed=3)
    c = build_model(TINY, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for ckpt in (False, True):
        model = build_model(dataclasses.replace(TINY, activation_checkpointing=ckpt), seed=0)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        grads.append((float(loss.detach()), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-6)
    assert all(torch.allclose(g, h, atol=1e-6) for g, h in zip(grads[0][1], grads[1][1]))


def test_initial_loss_is_near_uniform_over_the_vocabulary():
    model = build_model(TINY, seed=0)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    assert float(model(x[:, :-1], x[:, 1:]).detach()) == pytest.approx(
        torch.log(torch.tensor(64.0)).item(), rel=0.05
    )


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        Transformer(TINY)(torch.zeros(1, 17, dtype=torch.long))
