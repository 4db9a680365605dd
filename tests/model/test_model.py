"""The decoder: shapes, parameter counts, initial loss, and that it can learn."""

import math

import pytest
import torch
import torch.nn.functional as F

from lm.base.exits import Refused
from lm.model import ModelConfig, Transformer, apply_rope, rope_tables


def tiny(**kw) -> ModelConfig:
    return ModelConfig(
        **{"vocab_size": 100, "n_layer": 2, "d_model": 32, "n_head": 4, "max_seq_len": 16, **kw}
    )


def test_forward_shape_and_padded_vocab():
    cfg = tiny()
    assert cfg.padded_vocab_size == 128  # 100 rounded up to a multiple of 64
    logits = Transformer(cfg)(torch.randint(0, 100, (3, 16)))
    assert logits.shape == (3, 16, 128)


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [
        (dict(n_layer=18, d_model=2048, n_head=16), 1.0e9, 1.1e9),  # conf/model/1b.yaml
        (dict(n_layer=12, d_model=768, n_head=12), 130e6, 138e6),  # conf/model/134m.yaml
    ],
)
def test_preset_parameter_counts(preset, low, high):
    cfg = ModelConfig(vocab_size=32000, max_seq_len=2048, **preset)
    with torch.device("meta"):  # count without allocating 4 GB
        model = Transformer(cfg)
    n = model.num_parameters()
    assert low <= n <= high, n
    # The input embedding is the only thing the FLOPs count leaves out.
    assert n - model.num_parameters(exclude_embedding=True) == cfg.padded_vocab_size * cfg.d_model


def test_1b_preset_count_matches_config_file(compose):
    cfg = compose("model=1b", "data.vocab_size=32000", "data.seq_len=2048").model
    with torch.device("meta"):
        n = Transformer(ModelConfig(**cfg)).num_parameters()
    assert 1.0e9 <= n <= 1.1e9


def test_untrained_loss_is_near_uniform():
    torch.manual_seed(0)
    cfg = tiny(vocab_size=256)
    model = Transformer(cfg)
    x = torch.randint(0, 256, (8, 16))
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    assert abs(loss.item() - math.log(cfg.padded_vocab_size)) < 0.1


@pytest.mark.slow  # 26-74 s on 2 cores: the README command stays under 10 min
def test_overfits_one_batch():
    torch.manual_seed(0)
    model = Transformer(tiny())
    batch = torch.randint(0, 100, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


def test_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    x = torch.randint(0, 100, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 100
    assert torch.allclose(model(x)[0, :10], model(y)[0, :10], atol=1e-6)


def test_grouped_query_attention_and_tied_embeddings():
    cfg = tiny(n_kv_head=2, tie_embeddings=True)
    model = Transformer(cfg)
    assert model.blocks[0].attn.wk.weight.shape == (2 * cfg.head_dim, cfg.d_model)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model(torch.randint(0, 100, (2, 8))).shape == (2, 8, 128)
    untied = Transformer(tiny(n_kv_head=2))
    assert untied.num_parameters() - model.num_parameters() == 128 * 32


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = Transformer(tiny())
    x = torch.randint(0, 100, (2, 16))

    def grads(every: int) -> list[torch.Tensor]:
        model.zero_grad()
        model.ac_every = every
        model(x).float().pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(0), grads(1), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_rope_preserves_norm_and_is_relative():
    cfg = tiny()
    cos, sin = rope_tables(cfg)
    q = torch.randn(1, 1, 16, cfg.head_dim)
    assert torch.allclose(apply_rope(q, cos, sin).norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    # Scores depend on the offset only: the same vectors at positions (2, 5) and (7, 10) score alike.
    v = torch.randn(cfg.head_dim).expand(1, 1, 16, -1)
    r = apply_rope(v, cos, sin)[0, 0]
    assert torch.allclose(r[2] @ r[5], r[7] @ r[10], atol=1e-4)


def test_scaled_init_on_residual_projections():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, n_layer=8, d_model=256, n_head=4, max_seq_len=8)
    model = Transformer(cfg)
    expected = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    assert abs(model.blocks[0].attn.wo.weight.std().item() - expected) < 0.1 * expected
    assert abs(model.blocks[0].attn.wq.weight.std().item() - cfg.init_std) < 0.1 * cfg.init_std


@pytest.mark.parametrize(
    "bad",
    [dict(n_head=5), dict(n_kv_head=3), dict(n_layer=0)],
)
def test_bad_shapes_fail_with_the_key_named(bad):
    with pytest.raises(Refused, match="model\\."):
        tiny(**bad)
