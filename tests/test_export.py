"""lm <-> Hugging Face Llama: the weight map against transformers' own model, `lm export`, `model.init_from`."""

import pytest
import torch

from lm.hf import from_hf_state_dict, model_config_from_hf, to_hf_model
from lm.model import ModelConfig, Transformer

VARIANTS = {
    "gqa": dict(n_head=4, n_kv_head=2),
    "tied": dict(tie_embeddings=True),
    "untied": dict(tie_embeddings=False),
    "padded_vocab": dict(vocab_size=300, vocab_multiple=128),
    "rope_theta_norm_eps": dict(rope_theta=500000.0, norm_eps=1e-6),
}


def tiny_lm(**overrides) -> Transformer:
    """A tiny lm decoder with every weight random, RMSNorm gains included (init leaves them at 1, where a
    swapped norm would hide)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=320, n_layer=2, d_model=64, n_head=4, max_seq_len=32, vocab_multiple=64)
    model = Transformer(ModelConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def max_logit_diff(model: Transformer, hf, vocab: int | None = None) -> float:
    ids = torch.randint(
        0, model.cfg.vocab_size, (2, model.cfg.max_seq_len), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ours = model(ids)[..., :vocab]
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    return float((ours - theirs).abs().max())


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_logits_match_transformers_llama(variant):
    model = tiny_lm(**VARIANTS[variant])
    hf = to_hf_model(model, eos_id=0)
    assert max_logit_diff(model, hf) < 1e-4
    # ...and back: the HF weights rebuild the same lm model.
    again = Transformer(model_config_from_hf(hf.config, vocab_multiple=model.cfg.vocab_multiple))
    again.load_state_dict(from_hf_state_dict(hf.state_dict(), again.cfg))
    ids = torch.arange(16)[None]
    assert torch.equal(again.eval()(ids), model(ids))
