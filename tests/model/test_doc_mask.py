"""`model.doc_mask` (issue 36, item 5): attention does not cross an end-of-text inside a training window. Off
it is today's forward; on, a document's outputs do not depend on the documents before it in its window; it
trains in a real run with the data's end-of-text id, and the export is a plain Llama."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import lm.model
from lm.base.exits import EXIT_CONFIG, Refused, exit_code
from lm.cli import main as lm_cli
from lm.engine.kernels import check_liger_model
from lm.engine.module import LMModule
from lm.interop.hf import load_run, to_hf_model
from lm.model import ModelConfig, Transformer, dense_doc_mask, document_ids
from lm.numbers import memory
from lm.run.train import main

from ..interop.test_export import max_logit_diff, tiny_lm
from ..numbers.test_memory import saved_bytes

TINY = dict(vocab_size=100, n_layer=2, d_model=32, n_head=4, n_kv_head=2, max_seq_len=32)
EOT = 0


def two_documents(first: list[int], second_len: int = 12, batch: int = 2) -> torch.Tensor:
    """Windows of `first` (ending in EOT) followed by a second document of random ids (no EOT)."""
    second = torch.randint(1, 100, (batch, second_len), generator=torch.Generator().manual_seed(7))
    return torch.cat([torch.tensor(first).expand(batch, -1), second], dim=1)


def masked_model(**kw) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY, doc_mask=True, **kw)).eval()
    model.eot_id = EOT
    return model


def test_document_ids_keep_the_end_of_text_with_its_document():
    ids = torch.tensor([[5, 6, EOT, 7, EOT, EOT, 9, 9]])
    assert document_ids(ids, EOT).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    mask = dense_doc_mask(document_ids(ids, EOT))[0, 0]
    assert mask[3].tolist() == [False] * 3 + [True] + [False] * 4  # a new document sees only itself
    assert mask[2].tolist() == [True] * 3 + [False] * 5  # the EOT sees its own document
    assert mask.diagonal().all()  # no empty row, so no NaN


def test_off_is_todays_forward_on_todays_code_path(monkeypatch):
    """Off (or on without an end-of-text id: generation, the export's check): SDPA with is_causal and no mask,
    bitwise the logits of a config that never names the lever."""
    ids = two_documents([3, 4, 5, EOT])
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs["attn_mask"], kwargs["is_causal"]))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    today = Transformer(ModelConfig(**TINY))
    torch.manual_seed(0)
    off = Transformer(ModelConfig(**TINY, doc_mask=False))
    off.eot_id = EOT
    torch.manual_seed(0)
    unset = Transformer(ModelConfig(**TINY, doc_mask=True))  # no eot_id: one document per window
    with torch.no_grad():
        expected = today(ids)
        assert torch.equal(off(ids), expected) and torch.equal(unset(ids), expected)
    assert calls and all(mask is None and causal for mask, causal in calls)


@pytest.mark.parametrize("flex", [False, True], ids=["dense", "flex"])
def test_a_document_does_not_see_the_one_before_it(flex):
    """Changing document 1 changes nothing in document 2, whose logits equal those of document 2 alone at the
    window's start: RoPE positions stay absolute, and rotary attention depends only on offsets."""
    model = masked_model()
    model.flex = flex  # flex_attention's block mask, run eagerly on the CPU
    a = two_documents([3, 4, 5, 6, EOT])
    b = two_documents([9, 8, EOT, 7, EOT])  # other tokens, and two documents of its own before
    with torch.no_grad():
        la, lb = model(a)[..., :100], model(b)[..., :100]
        model.flex = False
        alone = model(a[:, 5:])[..., :100]
    assert torch.allclose(la[:, 5:], lb[:, 5:], atol=1e-6)
    assert torch.allclose(la[:, 5:], alone, atol=1e-5)
    assert not torch.allclose(la[:, :5], lb[:, :5], atol=1e-3)
    # Without the mask the second document does see the first.
    model.eot_id = None
    with torch.no_grad():
        assert not torch.allclose(model(a)[:, 5:, :100], alone, atol=1e-3)


def test_flex_block_mask_matches_the_dense_mask():
    model = masked_model()
    ids = torch.randint(1, 100, (3, 32), generator=torch.Generator().manual_seed(3))
    ids[0, [4, 20]] = EOT
    ids[1, [0, 31]] = EOT
    ids[2, 5:9] = EOT
    with torch.no_grad():
        dense = model(ids)[..., :100]
        model.flex = True
        flex = model(ids)[..., :100]
    assert torch.allclose(dense, flex, atol=1e-5)


def test_gradients_of_a_document_reach_only_its_own_tokens():
    model = masked_model()
    model.train()
    ids = two_documents([3, 4, 5, EOT], batch=1)
    emb = model.tok_emb(ids).detach().requires_grad_(True)
    model.tok_emb.forward = lambda _ids: emb  # the embeddings as a leaf, to read their gradient
    model(ids)[0, 4:, :100].sum().backward()
    assert emb.grad[0, :4].abs().max() == 0 and emb.grad[0, 4:].abs().max() > 0


def test_the_module_takes_the_datas_end_of_text_and_refuses_without_one():
    batch = torch.randint(1, 100, (2, 17), generator=torch.Generator().manual_seed(1))
    module = LMModule(ModelConfig(**TINY, doc_mask=True), {})
    with pytest.raises(Refused, match=r"model\.doc_mask=true needs the end-of-text id") as refused:
        module.loss(batch)
    assert exit_code(refused.value) == EXIT_CONFIG
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(eot_id=7, tokenizer=None))
    module.setup("fit")
    assert module.model.eot_id == 7 and torch.isfinite(module.loss(batch))
    off = LMModule(ModelConfig(**TINY), {})
    off._trainer = module._trainer
    off.setup("fit")
    assert off.model.eot_id is None  # off, the module never reads the manifest


def test_liger_and_checkpointing_serve_it():
    """Liger's kernels (norms, SwiGLU, RoPE, the fused loss) never touch attention: nothing to refuse. The
    checkpointed blocks recompute with the same mask."""
    check_liger_model(ModelConfig(**TINY, doc_mask=True))
    ids = two_documents([3, 4, 5, EOT], batch=2)
    window = torch.cat([ids, ids[:, :1]], dim=1)
    losses = []
    for every in (0, 1):
        torch.manual_seed(0)
        module = LMModule(ModelConfig(**TINY, doc_mask=True), {}, ac_every=every, eot_id=EOT).train()
        loss = module.loss(window)
        loss.backward()
        losses.append((loss.detach(), module.model.blocks[0].attn.wq.weight.grad.clone()))
    assert torch.equal(losses[0][0], losses[1][0]) and torch.allclose(losses[0][1], losses[1][1], atol=1e-7)


def test_memory_model_counts_the_dense_mask(monkeypatch):
    batch, seq = 2, 96
    cfg = ModelConfig(vocab_size=1000, max_seq_len=seq, n_layer=2, d_model=256, n_head=8, n_kv_head=2)
    on = ModelConfig(**{**cfg.__dict__, "doc_mask": True})
    monkeypatch.setattr(Transformer, "eot_id", EOT)  # saved_bytes builds its own model
    for precision in ("32-true", "bf16-mixed"):
        for ac_every in (0, 1):
            base = memory.estimate(cfg, batch_size=batch, seq_len=seq, precision=precision, ac_every=ac_every)
            est = memory.estimate(
                on, batch_size=batch, seq_len=seq, precision=precision, ac_every=ac_every, cuda=False
            )
            measured = saved_bytes(on, precision, ac_every, batch, seq) - saved_bytes(
                cfg, precision, ac_every, batch, seq
            )
            # The recomputed block's float copy lives only in the backward, where a forward's count cannot see it.
            recomputed = batch * seq * seq * (4 if precision == "32-true" else 2) if ac_every else 0
            assert est.activations - base.activations == measured + recomputed, (precision, ac_every)
        # On CUDA flex_attention keeps no (T, T) tensor.
        cuda = memory.estimate(on, batch_size=batch, seq_len=seq, precision=precision)
        assert (
            cuda.activations
            == memory.estimate(cfg, batch_size=batch, seq_len=seq, precision=precision).activations
        )


def test_compiles_without_graph_breaks_and_matches_eager():
    module = LMModule(ModelConfig(**TINY, doc_mask=True), {}, eot_id=EOT)
    ids = two_documents([3, 4, 5, EOT], second_len=13)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(module.loss)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    eager = module.loss(ids)
    module.model.compile()
    try:
        compiled = module.loss(ids)
    finally:
        torch._dynamo.reset()
    assert torch.allclose(compiled, eager, atol=1e-5), (float(compiled), float(eager))


def test_a_doc_mask_model_exports_as_a_plain_llama_with_its_single_document_logits():
    from lm.tools.export_gguf import check_gguf_portable

    model = tiny_lm(doc_mask=True)
    model.eot_id = EOT
    hf = to_hf_model(model, eos_id=EOT)
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = torch.randint(1, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    ids[:, -1] = EOT  # one document, closed by its end-of-text
    with torch.no_grad():
        assert float((model(ids)[..., :320] - hf(ids).logits).abs().max()) < 1e-4
    model.eot_id = None
    assert max_logit_diff(model, hf, vocab=320) < 1e-4
    check_gguf_portable(model.cfg)  # training only: llama.cpp's llama graph


def test_a_real_run_trains_with_the_datas_end_of_text_and_exports(tiny_cfg, tmp_path, monkeypatch):
    """Lightning, Hydra's schema, validation and milestone samples with model.doc_mask=true: the mask is
    built from the manifest's end-of-text id and windows hold several documents; `lm export` writes a Llama
    whose logits on one document are the run's."""
    built = []

    def spy(doc_BT):
        built.append(int(doc_BT.max()))
        return dense_doc_mask(doc_BT)

    monkeypatch.setattr(lm.model, "dense_doc_mask", spy)
    main(tiny_cfg("model.doc_mask=true", "trainer.max_steps=3", "kernels=eager", "sampling=off"))
    assert built and max(built) > 0  # a window crossed an end-of-text
    run = tmp_path / "runs" / "smoke"
    out = tmp_path / "hf"
    lm_cli(["export", str(run), "--out", str(out)])
    from transformers import AutoModelForCausalLM

    loaded = load_run(run)
    assert loaded.model.cfg.doc_mask and loaded.model.eot_id is None
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(1, 512, (1, 64), generator=torch.Generator().manual_seed(2))
    ids[0, -1] = loaded.eot_id
    loaded.model.eot_id = loaded.eot_id  # the training mask on: one document, the same logits
    with torch.no_grad():
        assert float((loaded.model.eval()(ids)[..., :512] - hf(ids).logits).abs().max()) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_on_cuda_matches_the_dense_mask_eager_and_compiled():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, "max_seq_len": 256, "d_model": 256}, doc_mask=True)).cuda()
    model.eot_id = EOT
    ids = torch.randint(1, 100, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ids[0, [30, 140]] = EOT
    ids[1, 200] = EOT
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model.flex = False
        dense = model(ids)[..., :100].float()
        model.flex = None  # CUDA's default: flex_attention
        flex = model(ids)[..., :100].float()
        model.compile()
        compiled = model(ids)[..., :100].float()
    assert torch.allclose(dense, flex, atol=3e-2) and torch.allclose(dense, compiled, atol=3e-2)


@pytest.mark.slow
def test_flex_under_a_whole_model_compile_matches_the_dense_mask_on_cpu():
    """`kernels=compile` compiles the whole model: the block mask must be built outside that graph (inside it
    Inductor could not lower flex_attention: torch 2.11 on an H100, 2.13 on this CPU). ~15 s of compile."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, "max_seq_len": 256, "d_model": 256}, doc_mask=True))
    model.eot_id = EOT
    ids = torch.randint(1, 100, (2, 256), generator=torch.Generator().manual_seed(1))
    ids[0, [30, 140]] = EOT
    ids[1, 200] = EOT
    with torch.no_grad():
        model.flex = False
        dense = model(ids)[..., :100]  # the padded vocabulary's logits are -inf
        model.flex = True
        model.compile()
        compiled = model(ids)[..., :100]
    assert float((dense - compiled).abs().max()) < 1e-4
