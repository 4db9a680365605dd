"""`lm export --format gguf`: the GGUF file llama.cpp loads (`llama`, or `qwen3` for `model.qk_norm`), read back
with the `gguf` package, and (slow, when llama-cpp-python is installed) run by llama.cpp itself against
transformers, for each architecture."""

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, AutoTokenizer

from lm.base.exits import Refused
from lm.cli import main as lm
from lm.data.stdlib import stdlib_documents
from lm.data.tokenizer import EOT, EOT_ID
from lm.interop.hf import load_run
from lm.model import ModelConfig
from lm.run.train import main
from lm.tools.export import export
from lm.tools.export_gguf import check_gguf_portable, gguf_vocabulary, interleave_rope, write_gguf

from .test_export import compose_run, opened, small_bpe, tiny_lm

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: pip install -e '.[export]'")

TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "naïve café — 東京 🚀  it's   spaced\t\ttabs\n\n\nand they'll've 12345 numbers",
    "The quick brown fox" + EOT + "jumps over the lazy dog.   ",
]


def rope(x: torch.Tensor, pairs: str, theta: float = 10000.0) -> torch.Tensor:
    """RoPE on (positions, heads, head_dim) with the pairs (i, i + d/2) ('half', lm and HF) or (2i, 2i + 1)
    ('interleaved', llama.cpp's Llama)."""
    t, _, d = x.shape
    angles = torch.arange(t)[:, None] * theta ** (-torch.arange(0, d, 2) / d)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = (x[..., : d // 2], x[..., d // 2 :]) if pairs == "half" else (x[..., 0::2], x[..., 1::2])
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1 if pairs == "interleaved" else -2).flatten(
        -2
    )


@pytest.mark.parametrize("heads", [4, 2])
def test_reordered_q_and_k_rows_give_llama_cpps_rope_the_same_attention_scores(heads):
    """A score q.k after lm's rotate-half RoPE equals the score after llama.cpp's interleaved RoPE of the
    projections whose rows `interleave_rope` reordered (without it, the scores differ)."""
    torch.manual_seed(0)
    wq, wk, x = torch.randn(heads * 16, 64), torch.randn(heads * 16, 64), torch.randn(10, 64)

    def scores(wq, wk, pairs):
        q, k = (rope((x @ w.T).view(10, heads, 16), pairs) for w in (wq, wk))
        return torch.einsum("thd,shd->hts", q, k)

    ours = scores(wq, wk, "half")
    assert torch.allclose(
        ours, scores(interleave_rope(wq, heads), interleave_rope(wk, heads), "interleaved"), atol=1e-4
    )
    assert not torch.allclose(ours, scores(wq, wk, "interleaved"), atol=1e-2)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    return small_bpe(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("tied", [False, True])
def test_gguf_file_holds_llama_metadata_gpt2_tokenizer_and_the_weights(tokenizer_json, tmp_path, dtype, tied):
    model = tiny_lm(vocab_size=400, vocab_multiple=64, n_kv_head=2, tie_embeddings=tied)  # 448 rows
    path = tmp_path / "m.gguf"
    write_gguf(
        opened(model, tokenizer_json, tmp_path / "tiny"), path, dtype=dtype, vocab="keep", license="mit"
    )
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "llama" and fields["general.license"] == "mit"
    assert fields["llama.block_count"] == 2 and fields["llama.embedding_length"] == 64
    assert fields["llama.attention.head_count"] == 4 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.freq_base"] == 10000.0 and fields["llama.context_length"] == 32
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    spec = json.loads(tokenizer_json.read_text())
    tokens = fields["tokenizer.ggml.tokens"]
    assert (
        len(tokens) == 448
        and tokens[EOT_ID] == EOT
        and tokens[399] == max(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    )
    types = fields["tokenizer.ggml.token_type"]
    assert types[EOT_ID] == gguf.TokenType.CONTROL and set(types[400:]) == {gguf.TokenType.UNUSED}
    assert fields["tokenizer.ggml.merges"][0] == " ".join(spec["model"]["merges"][0])
    assert fields["tokenizer.ggml.eos_token_id"] == fields["tokenizer.ggml.bos_token_id"] == EOT_ID
    assert fields["tokenizer.ggml.add_bos_token"] is False

    tensors = {t.name: t for t in reader.tensors}
    assert ("output.weight" in tensors) is not tied  # a tied model: llama.cpp reads token_embd twice
    kind = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}[dtype]
    assert tensors["blk.0.ffn_gate.weight"].tensor_type.name == kind
    assert tensors["blk.1.attn_norm.weight"].tensor_type.name == "F32"  # norm gains stay F32
    embd = gguf.quants.dequantize(tensors["token_embd.weight"].data, tensors["token_embd.weight"].tensor_type)
    tolerance = {"fp32": 0, "fp16": 1e-3, "bf16": 1e-2}[dtype]
    assert np.allclose(embd, model.tok_emb.weight.detach().numpy(), atol=tolerance, rtol=tolerance)
    k = gguf.quants.dequantize(
        tensors["blk.0.attn_k.weight"].data, tensors["blk.0.attn_k.weight"].tensor_type
    )
    expected = interleave_rope(model.blocks[0].attn.wk.weight.detach(), 2).numpy()
    assert k.shape == (32, 64) and np.allclose(k, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("tied", [False, True])
def test_qk_norm_exports_as_llama_cpps_qwen3_with_its_q_and_k_norm_gains(tokenizer_json, tmp_path, tied):
    """qwen3.* keys, every tensor under a name gguf lists for QWEN3, the per-head gains F32 as trained, and
    the q/k rows as lm has them: llama.cpp's qwen3 rotates halves (NEOX RoPE), as lm does."""
    model = tiny_lm(vocab_size=400, vocab_multiple=64, n_kv_head=2, qk_norm=True, tie_embeddings=tied)
    path = tmp_path / "q.gguf"
    write_gguf(opened(model, tokenizer_json, tmp_path / "tiny"), path, dtype="bf16", vocab="truncate",
               license=None)  # fmt: skip
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "qwen3" and not [k for k in fields if k.startswith("llama.")]
    assert fields["qwen3.block_count"] == 2 and fields["qwen3.attention.head_count_kv"] == 2
    eps = fields["qwen3.attention.layer_norm_rms_epsilon"]  # llama.cpp's q/k norms use it too, as lm's
    assert fields["qwen3.attention.key_length"] == 16 and eps == pytest.approx(1e-5)
    assert fields["tokenizer.ggml.pre"] == "gpt-2"
    tensors = {t.name: t for t in reader.tensors}
    qwen3 = {
        gguf.TENSOR_NAMES[t].format(bid=i) + ".weight"
        for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3]
        for i in range(2)
    }
    assert set(tensors) <= qwen3 and ("output.weight" in tensors) is not tied
    assert len(tensors) == 3 - tied + 2 * 11  # embedding, final norm, head; 9 Llama tensors + 2 gains a block
    for i, block in enumerate(model.blocks):
        for name, norm in (("attn_q_norm", block.attn.q_norm), ("attn_k_norm", block.attn.k_norm)):
            gain = tensors[f"blk.{i}.{name}.weight"]
            assert gain.tensor_type.name == "F32" and np.array_equal(gain.data, norm.weight.detach().numpy())
    k = tensors["blk.1.attn_k.weight"]
    k = gguf.quants.dequantize(k.data, k.tensor_type)
    ours = model.blocks[1].attn.wk.weight.detach().numpy()
    assert np.allclose(k, ours, atol=1e-2, rtol=1e-2)  # bf16, not reordered
    assert not np.allclose(k, interleave_rope(torch.from_numpy(ours), 2).numpy(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "levers", [dict(mlp="relu2_gated"), dict(mlp="relu2_gated", qk_norm=True)], ids=["llama", "qwen3"]
)
def test_gated_relu2_is_refused_naming_the_transformers_export_and_swiglu(levers):
    """No llama.cpp architecture computes lm's gated ReLU² MLP (its llama and qwen3 gate with SiLU): a GGUF
    would give other logits, so the refusal names the two ways out."""
    check_gguf_portable(ModelConfig(vocab_size=64, n_layer=1, d_model=32, n_head=2, qk_norm=True))
    with pytest.raises(Refused, match=r"--format gguf cannot carry model\.mlp=relu2_gated") as refused:
        check_gguf_portable(ModelConfig(vocab_size=64, n_layer=1, d_model=32, n_head=2, **levers))
    assert "--format hf" in str(refused.value) and "model.mlp=swiglu" in str(refused.value)


def test_truncate_writes_the_real_rows_as_the_hf_export(tokenizer_json, tmp_path):
    """`model.vocab_size` rows (not the padded 448); ids the BPE trainer left unfilled (400..409) are unused
    tokens, so the token list and the embedding rows agree."""
    model = tiny_lm(vocab_size=410, vocab_multiple=64)
    write_gguf(
        opened(model, tokenizer_json, tmp_path),
        tmp_path / "m.gguf",
        dtype="fp32",
        vocab="truncate",
        license=None,
    )
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 410
    assert set(reader.fields["tokenizer.ggml.token_type"].contents()[400:]) == {gguf.TokenType.UNUSED}
    assert "general.license" not in reader.fields
    assert {t.name: t for t in reader.tensors}["output.weight"].shape.tolist() == [64, 410]
    with pytest.raises(Refused, match="not this run's tokenizer"):
        write_gguf(opened(tiny_lm(vocab_size=300), tokenizer_json, tmp_path), tmp_path / "x.gguf",
                   dtype="fp32", vocab="truncate", license=None)  # fmt: skip


def test_a_tokenizer_that_is_not_lms_byte_level_bpe_is_refused_naming_the_way_out(tmp_path):
    words = Tokenizer(WordLevel({EOT: 0, "a": 1}, unk_token="a"))
    with pytest.raises(Refused, match="convert_hf_to_gguf.py"):
        gguf_vocabulary(json.loads(words.to_str()))


ARCHS = {"llama": [], "qwen3": ["model.qk_norm=true"]}
"""llama.cpp architecture -> the overrides of a run that exports as it."""


@pytest.fixture(scope="module", params=list(ARCHS))
def trained(request, tmp_path_factory, data_cache) -> Path:
    """One tiny real run per architecture (4 steps: tokenizer, weights and padded vocabulary rows as a
    user's)."""
    runs = tmp_path_factory.mktemp("runs")
    main(compose_run(runs, data_cache, "run.name=tiny", *ARCHS[request.param]))
    return runs / "tiny"


LOGIT_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
"""Largest |llama.cpp logit - transformers fp32 logit| on the tiny run: fp32 differs only in the order of
float sums (measured: llama 2.4e-7, 4.2e-3 without the q/k row reordering; qwen3 2.4e-7), bf16 rounds
every matrix (llama 2.7e-3, qwen3 2.8e-3)."""


def require_llama_cpp():
    return pytest.importorskip(
        "llama_cpp",
        reason="llama-cpp-python is not installed (it compiles llama.cpp, minutes): "
        "CMAKE_ARGS='-DGGML_NATIVE=OFF' pip install llama-cpp-python",
    )


def llama(path: Path, context: int):
    """llama.cpp on the GGUF file, its KV cache in F32 (its default F16 rounds every key and value)."""
    f32 = int(gguf.GGMLQuantizationType.F32)
    return require_llama_cpp().Llama(
        model_path=str(path),
        n_ctx=context,
        logits_all=True,
        n_threads=2,
        type_k=f32,
        type_v=f32,
        verbose=False,
    )


def llama_cpp_logits(llm, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of `ids` (one row per id)."""
    llm.reset()
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_llama_cpp_tokenizes_and_scores_the_gguf_export_as_transformers_the_hf_export(
    trained, tmp_path, monkeypatch, capsys, dtype
):
    require_llama_cpp()
    out = tmp_path / "tiny model.gguf"  # a space: the printed command must still paste into a shell
    lm(["export", str(trained), "--gguf", "--out", str(out), "--dtype", dtype, "--license", "mit"])
    assert f"llama-cli -m {shlex.quote(str(out))}" in capsys.readouterr().out
    arch = "qwen3" if load_run(trained).model_cfg.qk_norm else "llama"
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == arch
    export(trained, tmp_path / "hf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    context = load_run(trained).model_cfg.max_seq_len
    llm = llama(out, context)
    worst = 0.0
    for text in TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert ids == tokenizer(text)["input_ids"], text
        theirs = llama_cpp_logits(llm, ids[:context])
        with torch.no_grad():
            ours = model(torch.tensor([ids[:context]])).logits[0].numpy()
        assert theirs.shape == ours.shape  # every row, the padded vocabulary's included
        worst = max(worst, float(np.abs(theirs - ours).max()))
    print(f"llama.cpp {arch} {dtype} GGUF vs transformers fp32: max |logit difference| {worst:.2e}")
    for doc in stdlib_documents(
        max_bytes=400_000
    ).documents:  # 400 kB of source files: the same ids throughout
        assert (
            llm.tokenize(doc.text.encode(), add_bos=False, special=True) == tokenizer(doc.text)["input_ids"]
        )
    assert worst < LOGIT_TOLERANCE[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_llama_cpp_pairs_rope_dimensions_as_lm_does(tokenizer_json, tmp_path, qk_norm):
    """A 4-step model attends almost uniformly, where RoPE hardly matters: here q and k are scaled up until
    attention is sharp (with qk_norm the norms undo a scaled projection, so their gains are scaled), so
    llama.cpp's logits match lm's only if its RoPE pairs the same dimensions (measured: llama 3.6e-6 with
    the reordered rows, 5.9e-1 without; qwen3, tied, 2.1e-6 with the rows as lm's, 6.5e-1 reordered)."""
    require_llama_cpp()
    model = tiny_lm(vocab_size=400, vocab_multiple=64, n_kv_head=2, qk_norm=qk_norm, tie_embeddings=qk_norm)
    with torch.no_grad():
        for block in model.blocks:
            for weight in (
                (block.attn.q_norm.weight, block.attn.k_norm.weight)
                if qk_norm
                else (block.attn.wq.weight, block.attn.wk.weight)
            ):
                weight.mul_(5 if qk_norm else 30)
    path = tmp_path / "sharp.gguf"
    write_gguf(
        opened(model, tokenizer_json, tmp_path / "sharp"), path, dtype="fp32", vocab="truncate", license=None
    )
    llm = llama(path, 32)
    ids = llm.tokenize(TEXTS[0].encode(), add_bos=False, special=True)[:32]
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0, :, :400].numpy()  # the real rows (lm's padding ones are -inf)
    diff = float(np.abs(llama_cpp_logits(llm, ids) - ours).max())
    print(f"sharp attention: max |logit difference| {diff:.2e}")
    assert diff < 1e-3
