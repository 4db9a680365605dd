"""`lm export --format gguf`: a run's checkpoint as one GGUF file that llama.cpp (and Ollama, LM Studio,
llama-cpp-python) loads as it is.

llama.cpp's own `convert_hf_to_gguf.py` cannot convert an lm export: it names a BPE's pre-tokenizer by the
hash of how the vocabulary splits a fixed text, and a newly trained vocabulary has an unknown hash. Here the
pre-tokenizer is named from what it is: lm's tokenizer is a byte-level BPE whose pre-tokenizer is the GPT-2
regex (`tokenizers`' ByteLevel with `use_regex`), which is llama.cpp's `gpt-2` (its hand-written
`unicode_regex_split_custom_gpt2` is that regex, `\\s+` included). The file is written with the llama.cpp
project's own `gguf` package (the `export` extra): architecture keys, the tokenizer, then the tensors.

llama.cpp's Llama applies RoPE to interleaved pairs (dimensions 2i, 2i+1 of a head) where lm and Hugging
Face rotate halves (i, i + head_dim/2): the rows of the q and k projections are reordered per head to match,
the same reordering `convert_hf_to_gguf.py` applies to a Hugging Face Llama.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

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
        raise ValueError(
            f"the tokenizer has {len(tokenizer['tokens'])} ids but model.vocab_size={cfg.vocab_size}; "
            "it is not this run's tokenizer"
        )
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    add_metadata(writer, gguf, run, dtype, rows, license)
    add_tokenizer(writer, gguf, tokenizer, rows, run.eot_id)
    for name, tensor in gguf_tensors(run, rows):
        add_weight(writer, gguf, name, tensor, dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def check_gguf_portable(cfg: ModelConfig) -> None:
    """Refuse (exit 78) the recipe levers llama.cpp's `llama` graph does not compute: it would drop them and
    give other logits. The Hugging Face export (--format hf) carries qk_norm and gated ReLU²."""
    found = unportable(cfg)
    if cfg.qk_norm:
        found.append(
            "model.qk_norm=true (llama.cpp's llama graph has no q/k norms; --format hf writes Qwen3)"
        )
    if cfg.mlp == "relu2_gated":
        found.append(
            "model.mlp=relu2_gated (llama.cpp's llama graph gates with SiLU; --format hf carries it)"
        )
    if found:
        raise ValueError(f"--format gguf cannot carry {'; '.join(found)}")


def add_metadata(writer, gguf, run: Loaded, dtype: str, rows: int, license: str | None) -> None:
    """general.* and llama.* keys: what llama.cpp builds the graph from."""
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
        raise ValueError(
            "`lm export --format gguf` writes lm's own tokenizer (a byte-level BPE with the GPT-2 pre-tokenizer) "
            f"but this run's has model {model.get('type')!r}, pre_tokenizer {pre.get('type')!r}: export the "
            "Hugging Face folder (--format hf) and convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    ids = dict(model["vocab"])
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    ids |= {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    tokens = sorted(ids, key=ids.get)
    if [ids[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("the tokenizer's ids are not 0..n-1 without gaps; llama.cpp needs one token per id")
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
    """(GGUF name, lm tensor) for every weight, token rows cut to `rows`, q/k rows in llama.cpp's RoPE order.
    A tied model writes no `output`: llama.cpp then uses the token embedding, as for any tied Llama."""
    gguf = require_gguf()
    cfg, state = run.model_cfg, run.model.state_dict()
    names = {lm: gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[t]] for lm, t in TENSORS.items()}
    for i in range(cfg.n_layer):
        names |= {
            f"blocks.{i}.{lm}": gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[t]].format(bid=i)
            for lm, t in LAYER_TENSORS.items()
        }
    for lm_key, name in names.items():
        if lm_key == "lm_head.weight" and cfg.tie_embeddings:
            continue
        tensor = state[lm_key].detach().float()
        if lm_key in VOCAB_ROWS:
            tensor = tensor[:rows]
        elif lm_key.endswith("attn.wq.weight"):
            tensor = interleave_rope(tensor, cfg.n_head)
        elif lm_key.endswith("attn.wk.weight"):
            tensor = interleave_rope(tensor, cfg.kv_heads)
        yield f"{name}.weight", tensor


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
