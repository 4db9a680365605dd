"""`lm export --format gguf`: a run's checkpoint as one GGUF file that llama.cpp (and Ollama, LM Studio,
llama-cpp-python) loads as it is.

llama.cpp's own `convert_hf_to_gguf.py` cannot convert an lm export: it names a BPE's pre-tokenizer by the
hash of how the vocabulary splits a fixed text, and a newly trained vocabulary has an unknown hash. Here the
pre-tokenizer is named from what it is: lm's tokenizer is a byte-level BPE whose pre-tokenizer is the GPT-2
regex (`tokenizers`' ByteLevel with `use_regex`), which is llama.cpp's `gpt-2` (its hand-written
`unicode_regex_split_custom_gpt2` is that regex, `\\s+` included). The file is written with the llama.cpp
project's own `gguf` package (the `export` extra): architecture keys, the tokenizer, then the tensors.

The architecture is llama.cpp's `llama`, or its `qwen3` for `model.qk_norm` (Qwen3 is Llama with RMSNorm gains
over each head's queries and keys before RoPE, lm's order; the transformers export writes the same model as
Qwen3ForCausalLM). llama.cpp's `llama` applies RoPE to interleaved pairs (dimensions 2i, 2i+1 of a head) where
lm and Hugging Face rotate halves (i, i + head_dim/2): for it the rows of the q and k projections are
reordered per head to match, the same reordering `convert_hf_to_gguf.py` applies to a Hugging Face Llama.
Its `qwen3` rotates halves (NEOX RoPE) as lm does: rows and q/k norm gains are written as they are.
`model.mlp=relu2_gated` is refused: no llama.cpp architecture computes a gated ReLU² MLP with Llama's norms.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lm.base.exits import Refused
from lm.interop.hf import VOCAB_ROWS, Loaded, unportable
from lm.model import ModelConfig

EXTRA = "the gguf package is not installed; install the export extra: pip install -e '.[export]'"
GGUF_DTYPES = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}
"""--dtype -> the GGML type of the matrices (norm gains stay F32, as llama.cpp's converter keeps them)."""
FILE_TYPES = {"fp32": "ALL_F32", "fp16": "MOSTLY_F16", "bf16": "MOSTLY_BF16"}
TENSORS = {"tok_emb.weight": "TOKEN_EMBD", "norm.weight": "OUTPUT_NORM", "lm_head.weight": "OUTPUT"}
"""lm key -> gguf's MODEL_TENSOR for the tensors outside the blocks."""
LAYER_TENSORS = {
    "attn_norm.weight": "ATTN_NORM",
    "attn.wq.weight": "ATTN_Q",
    "attn.wk.weight": "ATTN_K",
    "attn.wv.weight": "ATTN_V",
    "attn.wo.weight": "ATTN_OUT",
    "mlp_norm.weight": "FFN_NORM",
    "mlp.w1.weight": "FFN_GATE",
    "mlp.w3.weight": "FFN_UP",
    "mlp.w2.weight": "FFN_DOWN",
}
"""lm key inside block i -> gguf's MODEL_TENSOR (named `blk.{i}.<...>`)."""
QK_NORM_TENSORS = {"attn.q_norm.weight": "ATTN_Q_NORM", "attn.k_norm.weight": "ATTN_K_NORM"}
"""`model.qk_norm`'s per-head gains inside block i -> gguf's MODEL_TENSOR (`qwen3` has them)."""
INTERLEAVED_ROPE = ("LLAMA",)
"""The architectures whose RoPE pairs dimensions (2i, 2i + 1) (llama.cpp's LLAMA_ROPE_TYPE_NORM), so lm's
q/k rows are reordered for them; `qwen3`'s is NEOX, lm's rotate-half."""
PRE_TOKENIZER = "gpt-2"


def require_gguf():
    """The gguf package, imported here: only `lm export --format gguf` needs it."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError(EXTRA) from e
    return gguf


def write_gguf(run: Loaded, path: Path, *, dtype: str, vocab: str, license: str | None) -> None:
    """The whole GGUF file of `run` at `path`: metadata, tokenizer and weights, `vocab` rows kept/truncated."""
    check_gguf_portable(run.model_cfg)
    gguf = require_gguf()
    tokenizer = gguf_vocabulary(json.loads(run.tokenizer_path.read_text(encoding="utf-8")))
    cfg = run.model_cfg
    rows = cfg.padded_vocab_size if vocab == "keep" else cfg.vocab_size  # as the Hugging Face export
    if len(tokenizer["tokens"]) > cfg.vocab_size:
        raise Refused(
            f"the tokenizer has {len(tokenizer['tokens'])} ids but model.vocab_size={cfg.vocab_size}; "
            "it is not this run's tokenizer"
        )
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[gguf_arch(cfg)]])
    add_metadata(writer, gguf, run, dtype, rows, license)
    add_tokenizer(writer, gguf, tokenizer, rows, run.eot_id)
    for name, tensor in gguf_tensors(run, rows):
        add_weight(writer, gguf, name, tensor, dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_arch(cfg: ModelConfig) -> str:
    """gguf's MODEL_ARCH of the model: `QWEN3` with `model.qk_norm`, else `LLAMA`."""
    return "QWEN3" if cfg.qk_norm else "LLAMA"


def check_gguf_portable(cfg: ModelConfig) -> None:
    """Refuse (exit 78) the recipe levers no llama.cpp graph computes: it would drop them and give other
    logits. llama.cpp fixes each architecture's MLP activation, and its few gated ReLU² graphs are other
    models (BitNet's extra sub-norms, Falcon OCR's gain-less norms and half-width RoPE), so
    model.mlp=relu2_gated has no GGUF architecture."""
    found = unportable(cfg)
    if cfg.mlp == "relu2_gated":
        found.append(
            "model.mlp=relu2_gated (llama.cpp's llama and qwen3 graphs gate with SiLU and none of its "
            "architectures computes a gated ReLU² MLP with Llama's norms: export it with --format hf, whose "
            "transformers model carries hidden_act relu2, or train with model.mlp=swiglu for llama.cpp)"
        )
    if found:
        raise Refused(f"--format gguf cannot carry {'; '.join(found)}")


def add_metadata(writer, gguf, run: Loaded, dtype: str, rows: int, license: str | None) -> None:
    """general.* and the architecture's (llama.*, qwen3.*) keys: what llama.cpp builds the graph from."""
    cfg = run.model_cfg
    writer.add_type("model")
    writer.add_name(run.run_dir.name)
    if license:
        writer.add_license(license)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.hidden_dim)
    writer.add_block_count(cfg.n_layer)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(rows)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[dtype]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def gguf_vocabulary(spec: dict[str, Any]) -> dict[str, Any]:
    """tokens (by id), their special flags and merges of a tokenizer.json that is lm's byte-level BPE; a
    ValueError naming the problem for any other tokenizer (llama.cpp would split its text differently)."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    gpt2 = (
        model.get("type") == "BPE"
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        and spec.get("normalizer") is None
    )
    if not gpt2:
        raise Refused(
            "`lm export --format gguf` writes lm's own tokenizer (a byte-level BPE with the GPT-2 pre-tokenizer) "
            f"but this run's has model {model.get('type')!r}, pre_tokenizer {pre.get('type')!r}: export the "
            "Hugging Face folder (--format hf) and convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    ids = dict(model["vocab"])
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    ids |= {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    tokens = sorted(ids, key=ids.get)
    if [ids[t] for t in tokens] != list(range(len(tokens))):
        raise Refused("the tokenizer's ids are not 0..n-1 without gaps; llama.cpp needs one token per id")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    added = {t["content"] for t in spec.get("added_tokens", [])}
    return {"tokens": tokens, "special": special, "added": added, "merges": merges}


def add_tokenizer(writer, gguf, vocab: dict[str, Any], rows: int, eot_id: int) -> None:
    """tokenizer.ggml.*: a `gpt2` BPE with the `gpt-2` pre-tokenizer; rows past the tokenizer's ids (lm's
    padding, or a vocabulary the BPE trainer did not fill) are unused tokens.
    End of text is bos, eos and pad, and nothing is added to a text (as the Hugging Face export)."""
    types = gguf.TokenType
    kinds = [
        types.CONTROL
        if t in vocab["special"]
        else types.USER_DEFINED
        if t in vocab["added"]
        else types.NORMAL
        for t in vocab["tokens"]
    ]
    padding = range(len(vocab["tokens"]), rows)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list([*vocab["tokens"], *(f"[PAD{i}]" for i in padding)])
    writer.add_token_types([*kinds, *(types.UNUSED for _ in padding)])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(eot_id)
    writer.add_eos_token_id(eot_id)
    writer.add_pad_token_id(eot_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def gguf_tensors(run: Loaded, rows: int):
    """(GGUF name, lm tensor) for every weight, token rows cut to `rows`, q/k rows in the architecture's RoPE
    order. A tied model writes no `output`: llama.cpp then uses the token embedding (`llama` and `qwen3`)."""
    cfg, state = run.model_cfg, run.model.state_dict()
    interleave = gguf_arch(cfg) in INTERLEAVED_ROPE
    for lm_key, name in tensor_names(cfg).items():
        if lm_key == "lm_head.weight" and cfg.tie_embeddings:
            continue
        tensor = state[lm_key].detach().float()
        if lm_key in VOCAB_ROWS:
            tensor = tensor[:rows]
        elif interleave and lm_key.endswith("attn.wq.weight"):
            tensor = interleave_rope(tensor, cfg.n_head)
        elif interleave and lm_key.endswith("attn.wk.weight"):
            tensor = interleave_rope(tensor, cfg.kv_heads)
        yield f"{name}.weight", tensor


def tensor_names(cfg: ModelConfig) -> dict[str, str]:
    """Every lm state-dict key -> its GGUF tensor name (without `.weight`): gguf's `TENSOR_NAMES`, the names
    llama.cpp's loader looks up (each one of gguf's `MODEL_TENSORS` of the architecture)."""
    gguf = require_gguf()
    layer = LAYER_TENSORS | QK_NORM_TENSORS if cfg.qk_norm else LAYER_TENSORS
    names = {lm: gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[t]] for lm, t in TENSORS.items()}
    for i in range(cfg.n_layer):
        names |= {
            f"blocks.{i}.{lm}": gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[t]].format(bid=i)
            for lm, t in layer.items()
        }
    return names


def interleave_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection reordered per head from rotate-half pairs (i, i + d/2) to llama.cpp's
    interleaved pairs (2i, 2i + 1): row i -> 2i, row i + d/2 -> 2i + 1 of each head."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).transpose(1, 2).reshape(weight.shape)


def add_weight(writer, gguf, name: str, tensor: torch.Tensor, dtype: str) -> None:
    """One tensor in the asked type; 1-D tensors (the norm gains) stay F32."""
    data = tensor.contiguous().numpy()
    kind = gguf.GGMLQuantizationType[GGUF_DTYPES[dtype] if data.ndim > 1 else "F32"]
    if kind == gguf.GGMLQuantizationType.BF16:  # numpy has no bfloat16: gguf packs its bytes
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    else:
        writer.add_tensor(
            name, data.astype(np.float16 if kind == gguf.GGMLQuantizationType.F16 else np.float32)
        )
