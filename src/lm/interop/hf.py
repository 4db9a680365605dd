"""lm's decoder as a Hugging Face `LlamaForCausalLM` and back, and the one loader of a trained run.

lm's decoder is numerically a standard Llama (rotate-half RoPE like HF, so no q/k permutation): conversion
is a renaming of state-dict keys, one table read in both directions (`KEYS`, `LAYER_KEYS`), plus the
vocabulary rows that lm pads to `model.vocab_multiple`. One vocabulary rule holds in all three places:
`model.vocab_size` ids are real; lm masks its padding ids to -inf (`lm.model.mask_padding`), an export
writes the real rows only, and `model.init_from` takes a model whose vocabulary is exactly
`data.vocab_size`, so its loss, transformers' loss on an export and the first loss of an init_from run agree. `load_run` is what `lm sample`, `lm export` and
`lm eval` open a run with: the weights, the config they were built from and the run's own tokenizer.

`transformers` is an optional dependency (the `export` extra): it is imported inside the functions that
build its objects, so `lm sample` and training never need it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.checkpoint import files
from lm.model import ModelConfig, Transformer
from lm.store import rundir

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

KEYS = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
"""lm key -> HF key for the tensors outside the blocks."""
LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
"""lm key -> HF key inside block i (`blocks.{i}.` <-> `model.layers.{i}.`)."""
QK_NORM_KEYS = {
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}
"""The per-head query/key norm gains of `model.qk_norm` (Qwen3's names), inside block i."""
HIDDEN_ACT = {"swiglu": "silu", "relu2_gated": "relu2"}
"""`model.mlp` -> the `hidden_act` of the Llama/Qwen3 MLP (down(act(gate) * up)) that computes it."""
VOCAB_ROWS = ("tok_emb.weight", "lm_head.weight")
"""lm tensors with one row per token id: padded in lm, cut to the real vocabulary in HF (`to_hf_model`)."""
VOCAB = ("truncate", "keep")
"""What `lm export --vocab` writes of the padded rows (`to_hf_model`); the first is the default."""
MODEL_INPUTS = ["input_ids", "attention_mask"]
"""What the export's tokenizer returns: what LlamaForCausalLM's forward and generate take."""
EXTRA = "{name} is not installed; install the export extra: pip install -e '.[export]'"


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """Every lm state-dict key of a model of `cfg` -> its HF key."""
    keys = dict(KEYS)
    layer_keys = LAYER_KEYS | QK_NORM_KEYS if cfg.qk_norm else LAYER_KEYS
    for i in range(cfg.n_layer):
        keys |= {f"blocks.{i}.{lm}": f"model.layers.{i}.{hf}" for lm, hf in layer_keys.items()}
    return keys


def unportable(cfg: ModelConfig) -> list[str]:
    """The options of `cfg` that no unmodified transformers architecture computes, each named with why: an
    export would drop them and give other logits, so `lm export` and `model.init_from` refuse them."""
    found = []
    if cfg.mlp not in HIDDEN_ACT:
        found.append(f"model.mlp={cfg.mlp} (a non-gated MLP: Llama and Qwen3 have a gate projection)")
    if cfg.logit_softcap is not None:
        found.append(f"model.logit_softcap={cfg.logit_softcap} (Llama and Qwen3 do not cap their logits)")
    return found


def check_portable(cfg: ModelConfig) -> None:
    """Refuse (ValueError: exit 78) a model that `unportable` finds options in, naming each of them."""
    found = unportable(cfg)
    if found:
        raise Refused(
            f"this model cannot be exported to a transformers architecture: {'; '.join(found)}. "
            "It trains, samples and evaluates in lm; train with these options off to export"
        )


def to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig, *, vocab_size: int | None = None
) -> dict[str, torch.Tensor]:
    """lm weights under HF Llama names; `vocab_size` cuts the token rows to that many (None keeps lm's
    padded rows, which gives exactly lm's logits)."""
    rows = model_cfg.padded_vocab_size if vocab_size is None else vocab_size
    if not 0 < rows <= model_cfg.padded_vocab_size:
        raise Refused(f"vocab_size={rows} must lie in 1..{model_cfg.padded_vocab_size} (the padded rows)")
    out = {}
    for lm_key, hf_key in key_map(model_cfg).items():
        tensor = state_dict[lm_key]
        out[hf_key] = tensor[:rows] if lm_key in VOCAB_ROWS else tensor
    return out


def from_hf_state_dict(
    state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """HF Llama weights under lm names, the token rows padded with zeros up to lm's padded vocabulary (a
    padding row is never a target, and `lm.interop.generate` never samples one).

    A tied HF checkpoint may hold no `lm_head.weight` (safetensors stores a shared tensor once): the
    embedding stands in for it."""
    out = {}
    for lm_key, hf_key in key_map(model_cfg).items():
        if hf_key not in state_dict and lm_key == "lm_head.weight" and model_cfg.tie_embeddings:
            hf_key = KEYS["tok_emb.weight"]
        if hf_key not in state_dict:
            raise Refused(f"the Hugging Face weights have no {hf_key}; they are not a Llama of this shape")
        tensor = state_dict[hf_key]
        out[lm_key] = pad_rows(tensor, model_cfg.padded_vocab_size) if lm_key in VOCAB_ROWS else tensor
    return out


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows appended up to `rows`."""
    if tensor.shape[0] > rows:
        raise Refused(
            f"the Hugging Face model has {tensor.shape[0]} vocabulary rows but this config pads to {rows}; "
            f"set model.vocab_size (data.vocab_size) to at least {tensor.shape[0]}"
        )
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def hf_config(model_cfg: ModelConfig, *, eos_id: int, vocab_size: int | None = None) -> LlamaConfig:
    """The LlamaConfig of an lm model, a Qwen3Config with `model.qk_norm` (Llama's with q/k norms): `vocab_size`
    None means lm's padded rows. `check_portable` has refused what neither computes.

    Both rope spellings are kept: `rope_parameters` (transformers >= 4.56) and the older top-level
    `rope_theta`, since a reader that drops the theta silently changes every logit. End of text is both bos
    and eos. No `pad_token_id` here although the tokenizer pads with end of text (`hf_tokenizer`): Llama
    makes it the embedding's `padding_idx`, a row whose gradient is zero, so fine-tuning the export would
    never update the end-of-text embedding."""
    transformers = require_transformers()
    check_portable(model_cfg)
    qwen3 = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": model_cfg.n_layer}
    make = transformers.Qwen3Config if model_cfg.qk_norm else transformers.LlamaConfig
    config = make(
        vocab_size=model_cfg.padded_vocab_size if vocab_size is None else vocab_size,
        hidden_size=model_cfg.d_model,
        intermediate_size=model_cfg.hidden_dim,
        num_hidden_layers=model_cfg.n_layer,
        num_attention_heads=model_cfg.n_head,
        num_key_value_heads=model_cfg.kv_heads,
        head_dim=model_cfg.head_dim,
        hidden_act=HIDDEN_ACT[model_cfg.mlp],
        max_position_embeddings=model_cfg.max_seq_len,
        initializer_range=model_cfg.init_std,
        rms_norm_eps=model_cfg.norm_eps,
        tie_word_embeddings=model_cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": model_cfg.rope_theta},
        attention_bias=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        **(qwen3 if model_cfg.qk_norm else {"mlp_bias": False}),
    )
    config.rope_theta = model_cfg.rope_theta  # set after init: an attribute to_dict() writes out
    return config


def model_config_from_hf(config: LlamaConfig | dict[str, Any], **rest: Any) -> ModelConfig:
    """The ModelConfig of an HF Llama config (the inverse of `hf_config`); `rest` sets the fields HF does not
    describe (`vocab_multiple`, `init_std`, ...). A config lm cannot express (`FIELDS`) is refused, naming
    each field with both values."""
    c = config if isinstance(config, dict) else config.to_dict()
    mlp = {act: mlp for mlp, act in HIDDEN_ACT.items()}.get(c.get("hidden_act"), "swiglu")  # else: refused
    model_cfg = ModelConfig(
        vocab_size=c["vocab_size"],
        n_layer=c["num_hidden_layers"],
        d_model=c["hidden_size"],
        n_head=c["num_attention_heads"],
        n_kv_head=source_value(c, "num_key_value_heads"),
        ffn_hidden=c["intermediate_size"],
        max_seq_len=c["max_position_embeddings"],
        rope_theta=source_value(c, "rope_theta"),
        norm_eps=c["rms_norm_eps"],
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qk_norm=c.get("model_type") == "qwen3",
        mlp=mlp,
        **rest,
    )
    wrong = mismatches(c, model_cfg)
    if wrong:
        raise Refused(f"this Hugging Face model is not one lm can load: {'; '.join(wrong)}")
    return model_cfg


@dataclass(frozen=True)
class Field:
    """One config.json field against what lm uses for it."""

    hf: str
    """The field of the Hugging Face config (`SOURCE` reads the ones spelled several ways)."""
    lm: Callable[[ModelConfig], Any]
    """What lm's model of this config has there."""
    key: str | None = None
    """The lm config key that sets it; None: lm's decoder has no setting for it (a fixed part of it)."""
    choices: str | None = None
    """For a field a recipe lever picks among a few values (not a number a key sets): which, and how."""


QK_NORM_CHOICES = "model.qk_norm picks it: false 'llama', true 'qwen3'"
MLP_CHOICES = "model.mlp picks it: " + ", ".join(f"{mlp} {act!r}" for mlp, act in HIDDEN_ACT.items())


FIELDS = (
    Field("model_type", lambda m: "qwen3" if m.qk_norm else "llama", choices=QK_NORM_CHOICES),
    Field("hidden_act", lambda m: HIDDEN_ACT.get(m.mlp), choices=MLP_CHOICES),  # the gate's activation
    Field("attention_bias", lambda m: False),
    Field("mlp_bias", lambda m: False),
    Field("attention_dropout", lambda m: 0.0),
    Field("rope_type", lambda m: "default"),  # plain RoPE, no scaling
    Field("sliding_window", lambda m: None),  # full causal attention
    Field("use_sliding_window", lambda m: False),
    Field("head_dim", lambda m: m.head_dim),  # always d_model / n_head in lm
    Field("num_hidden_layers", lambda m: m.n_layer, "model.n_layer"),
    Field("hidden_size", lambda m: m.d_model, "model.d_model"),
    Field("num_attention_heads", lambda m: m.n_head, "model.n_head"),
    Field("num_key_value_heads", lambda m: m.kv_heads, "model.n_kv_head"),
    Field("intermediate_size", lambda m: m.hidden_dim, "model.ffn_hidden"),
    Field("rope_theta", lambda m: m.rope_theta, "model.rope_theta"),
    Field("rms_norm_eps", lambda m: m.norm_eps, "model.norm_eps"),
    Field("tie_word_embeddings", lambda m: m.tie_embeddings, "model.tie_embeddings"),
    Field("vocab_size", lambda m: m.vocab_size, "data.vocab_size"),  # model.vocab_size follows it
)
"""Every Hugging Face config field that `model.init_from` must find as lm would build it: the fixed parts of
lm's decoder first, then the ones a config key sets. A new architecture feature in lm is one more row here, its
`lm` reading the ModelConfig field that expresses it (`model.qk_norm` is Qwen3's model_type, `model.mlp` its
hidden_act)."""


def rope_of(c: dict[str, Any]) -> dict[str, Any]:
    """The rope settings: `rope_parameters` (transformers >= 5) or the older `rope_scaling`."""
    return c.get("rope_parameters") or c.get("rope_scaling") or {}


SOURCE: dict[str, Callable[[dict[str, Any]], Any]] = {
    "rope_type": lambda c: rope_of(c).get("rope_type") or rope_of(c).get("type") or "default",
    "rope_theta": lambda c: float(rope_of(c).get("rope_theta") or c.get("rope_theta") or 10000.0),
    "num_key_value_heads": lambda c: c.get("num_key_value_heads") or c["num_attention_heads"],
    "head_dim": lambda c: c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
}
"""config.json fields that are absent, None or spelled in several places, read as transformers reads them."""


def source_value(c: dict[str, Any], field: str, absent: Any = None) -> Any:
    """The value of `field` in the HF config dict `c` (`absent` when the config has no such field)."""
    return SOURCE[field](c) if field in SOURCE else c.get(field, absent)


FLOAT_RTOL = 1e-6
"""How far a config float may be from lm's, relatively: a config written from a GGUF holds float32 values
(`rms_norm_eps=9.999999747378752e-06` for 1e-05), ~1e-8 apart; a real difference is orders larger."""


def same(theirs: Any, ours: Any) -> bool:
    """Equal, or both non-integer numbers within `FLOAT_RTOL` of each other."""
    floats = isinstance(theirs, float) or isinstance(ours, float)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (theirs, ours))
    return theirs == ours or (floats and numbers and math.isclose(theirs, ours, rel_tol=FLOAT_RTOL))


def mismatches(c: dict[str, Any], model_cfg: ModelConfig) -> list[str]:
    """Each field of `FIELDS` where the HF config `c` differs from what lm builds for `model_cfg`, named
    with both values (a field the config lacks is taken to be lm's)."""
    wrong = []
    for f in FIELDS:
        ours = f.lm(model_cfg)
        theirs = source_value(c, f.hf, ours)
        if same(theirs, ours):
            continue
        if f.key is None:
            wrong.append(
                f"its {f.hf}={theirs!r} but lm's decoder has {f.hf}={ours!r} "
                f"({f.choices or 'no lm setting changes it'})"
            )
        else:
            wrong.append(f"{f.key}={ours} but its {f.hf}={theirs}")
    return wrong


def to_hf_model(
    model: Transformer | dict[str, torch.Tensor],
    *,
    eos_id: int,
    model_cfg: ModelConfig | None = None,
    vocab: str = "truncate",
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """An lm model (or its state dict + `model_cfg`) as an HF LlamaForCausalLM (Qwen3ForCausalLM with
    `model.qk_norm`) in memory, in eval mode; a ValueError naming each option neither computes.

    `vocab="truncate"` (the default) writes the real vocabulary, `model.vocab_size` rows: the HF model's
    logits, softmax and loss are lm's (whose padding ids have -inf logits). `"keep"` keeps lm's padded rows
    for aligned shapes; HF has no logit mask, so there the padding ids take a little probability (their
    logits are those of never-trained rows) and generation is only told never to pick one
    (`suppress_tokens`)."""
    transformers = require_transformers()
    if isinstance(model, Transformer):
        model_cfg, state_dict = model.cfg, model.state_dict()
    elif model_cfg is None:
        raise ValueError("to_hf_model of a state dict needs its model_cfg")
    else:
        state_dict = model
    if vocab not in VOCAB:
        raise Refused(f"vocab={vocab!r} is unknown; use one of {', '.join(VOCAB)}")
    real = model_cfg.vocab_size
    rows = model_cfg.padded_vocab_size if vocab == "keep" else real
    config = hf_config(model_cfg, eos_id=eos_id, vocab_size=rows)
    hf = (transformers.Qwen3ForCausalLM if model_cfg.qk_norm else transformers.LlamaForCausalLM)(config)
    hf.load_state_dict(to_hf_state_dict(state_dict, model_cfg, vocab_size=rows), strict=True)
    # Batched generation pads with end of text (the tokenizer's pad token), the only special token lm has.
    hf.generation_config.bos_token_id = hf.generation_config.eos_token_id = eos_id
    hf.generation_config.pad_token_id = eos_id
    if rows > real:
        hf.generation_config.suppress_tokens = list(range(real, rows))
    return hf.to(dtype).eval()


INIT_FROM_FIX = "set those keys to its values (or start without model.init_from)"


def init_from_findings(model_cfg: ModelConfig, seq_len: int | None = None) -> list[Finding]:
    """The check of `model.init_from` (the doctor's, before the run directory or its lock exists): refused
    without the export extra, with a config.json that cannot be read, and for each field lm would build
    otherwise (`FIELDS`); a warning where a training window (`seq_len`: data.seq_len) is longer than the
    context the source model was trained for."""
    name = model_cfg.init_from
    if name is None:
        return []
    try:
        c = read_hf_config(name)
    except ImportError as e:
        return [Finding("init_from", "error", f"model.init_from={name} is read with transformers: {e}")]
    except Refused as e:
        return [Finding("init_from", "error", str(e), fix="model.init_from=<a Hugging Face Llama folder>")]
    found = [
        Finding("init_from", "error", f"model.init_from={name}: {wrong}", fix=INIT_FROM_FIX)
        for wrong in mismatches(c, model_cfg)
    ]
    found += [
        Finding("init_from", "error", f"model.init_from={name} cannot carry {option}", fix="turn it off")
        for option in unportable(model_cfg)
    ]
    context = c.get("max_position_embeddings")
    if seq_len is not None and context is not None and seq_len > context:
        what = f"data.seq_len={seq_len} is longer than its max_position_embeddings={context}: positions it never saw"
        found.append(Finding("init_from", "warn", what, fix=f"data.seq_len={context}"))
    return found or [Finding("init_from", "ok", f"starts from {name}")]


def check_init_from(model_cfg: ModelConfig) -> None:
    """Refuse (exit 78) what `init_from_findings` refuses. The doctor has refused such a run already, before
    the run directory changed, unless it is off or the run was to resume a remote checkpoint (this runs
    once the run knows it starts fresh)."""
    errors = [f.what for f in init_from_findings(model_cfg) if f.level == "error"]
    if errors:
        raise Refused(f"{'; '.join(errors)}. Set these keys to its values (or start without model.init_from)")


def read_hf_config(name: str) -> dict[str, Any]:
    """config.json of an HF folder or Hub name (downloaded when online), as a dict; an ImportError without
    the export extra."""
    transformers = require_transformers()
    try:
        return transformers.AutoConfig.from_pretrained(name).to_dict()
    except (OSError, ValueError) as e:  # a refusal (exit 78), not a crash that `lm supervise` would retry
        raise Refused(
            f"model.init_from={name} is neither a Hugging Face model folder (with config.json) nor a Hub model "
            f"this machine can download: {e}"
        ) from e


def load_init_from(model: Transformer) -> None:
    """Overwrite `model`'s weights with those of `model.init_from` (checked by `check_init_from`)."""
    transformers = require_transformers()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model.cfg.init_from, dtype=torch.float32)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), model.cfg), strict=True)


def hf_tokenizer(
    tokenizer_json: Path, eot_token: str, model_max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """The run's tokenizer as a transformers tokenizer: the same ids for every text (nothing added: no bos
    prepended), end of text as eos, bos and pad (lm's tokenizer has no other special token: a pad of its own
    would be a new id the model never saw); `model_max_length` is the model's context.

    `model_input_names` leaves out `token_type_ids`, which transformers 4.x's fast tokenizer returns by
    default and its `generate(**tokenizer(text, return_tensors="pt"))` refuses as an unused model input.
    Padding is on the left (saved in tokenizer_config.json): a decoder-only model continues from the last
    position, so `generate(**tokenizer(batch, padding=True))` is right as loaded (right padding puts pad
    tokens before the continuation, and transformers warns). lm-eval sets its own side per request."""
    transformers = require_transformers()
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json),
        eos_token=eot_token,
        bos_token=eot_token,
        pad_token=eot_token,
        model_input_names=MODEL_INPUTS,
        padding_side="left",
        **extra,
    )


def require_transformers():
    """transformers (and safetensors, its weights' format), imported here: heavy (seconds), and only the
    export/eval extras install them."""
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError as e:
        raise ImportError(EXTRA.format(name=e.name or "transformers")) from e
    return transformers


@dataclass
class Loaded:
    """A trained run opened for use: what sampling, export and evaluation need."""

    model: Transformer
    """The decoder with the checkpoint's weights, in eval mode on the CPU."""
    model_cfg: ModelConfig
    run_dir: Path
    ckpt: Path
    step: int
    """The optimizer step the checkpoint was saved at."""
    tokenizer_path: Path
    """`<run dir>/tokenizer.json`: the tokenizer the run trained with, kept in the run directory."""
    eot_token: str
    eot_id: int
    """End-of-text id: generation stops at it; HF's eos and bos."""


def load_run(path: str | Path, device: str = "cpu") -> Loaded:
    """Open a run directory (its `checkpoints/last.ckpt`) or a checkpoint inside `<run dir>/checkpoints/`.

    Only the run directory is read: the tokenizer is the run's own copy, so the run samples and exports the
    same on any machine, with or without the data cache."""
    path = Path(path)
    # a run directory, or a checkpoint: a file, or a sharded folder (checkpoint.format=sharded)
    is_run = path.is_dir() and not (path / files.SHARDED_META).exists()
    run_dir, ckpt = (path, path / rundir.CHECKPOINTS / files.LAST) if is_run else (None, path)
    if not ckpt.exists():
        raise FileNotFoundError(
            f"no checkpoint at {ckpt}; pass a run directory (runs/<name>) or runs/<name>/checkpoints/*.ckpt"
        )
    run_dir = run_dir or ckpt.absolute().parents[1]
    tokenizer = rundir.read_tokenizer(run_dir)
    saved = files.read(ckpt)
    model_cfg = ModelConfig(**saved["hyper_parameters"]["model"])
    model = Transformer(model_cfg)
    prefix = "model."
    model.load_state_dict(
        {k[len(prefix) :]: v for k, v in saved["state_dict"].items() if k.startswith(prefix)}, strict=True
    )
    return Loaded(
        model=model.to(device).eval(),
        model_cfg=model_cfg,
        run_dir=run_dir,
        ckpt=ckpt,
        step=int(saved["global_step"]),
        tokenizer_path=run_dir / rundir.TOKENIZER,
        eot_token=tokenizer["eot_token"],
        eot_id=tokenizer["eot_id"],
    )
