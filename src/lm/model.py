"""A Llama-style decoder-only transformer, built from one ModelConfig.

RMSNorm pre-normalisation, rotary position embeddings, SwiGLU MLP, causal attention through
`F.scaled_dot_product_attention` (flash kernel on GPUs), optional grouped-query attention and tied
embeddings. The recipe levers (`qk_norm`, `mlp`, `logit_softcap`, `z_loss`, `zero_init_proj`, `doc_mask`) are off by
default: off, the model, its state-dict keys, initialisation and numerics are those of the plain Llama. Shapes: B batch, T time, D model width, H query heads, K key/value heads, E head dim, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from lm.base.exits import Refused

MLP_NAMES = ("swiglu", "relu2_gated", "relu2")
"""The values of `model.mlp` (`MLPS` builds them)."""


@dataclass
class ModelConfig:
    """Architecture of the decoder. Saved inside every checkpoint, so a checkpoint rebuilds its own model."""

    vocab_size: int = 4096
    """The real vocabulary: the ids the softmax covers. The embedding and head are padded up to a multiple of
    `vocab_multiple` for aligned matmuls; the padding ids get -inf logits (`mask_padding`), so they never
    take probability, and `lm export` writes only the real rows."""
    n_layer: int = 4
    """Transformer blocks."""
    d_model: int = 128
    """Residual stream width."""
    n_head: int = 4
    """Query heads; head dim = d_model / n_head."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); None means n_head (plain multi-head attention)."""
    ffn_hidden: int | None = None
    """SwiGLU hidden width; None uses Llama's rule: 8/3 d_model rounded up to `ffn_multiple`."""
    ffn_multiple: int = 256
    """Rounding of the default SwiGLU width (keeps matmuls on tensor-core friendly shapes)."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection (saves V x D parameters)."""
    init_std: float = 0.02
    """Std of the normal initialisation; residual output projections get init_std / sqrt(2 n_layer)."""
    vocab_multiple: int = 64
    """Pad the embedding rows to a multiple of this (a free GPU speed-up: aligned matmul shapes)."""
    init_from: str | None = None
    """A Hugging Face Llama folder (`lm export`'s) or Hub name whose weights a fresh run starts from
    (continued pretraining) instead of `init_std`'s; its config.json must describe this architecture, and its
    tokenizer becomes data.tokenizer. A resume ignores it: the checkpoint has the weights."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before RoPE (Qwen3, OLMo-2): bounds the attention logits.
    Adds two gains of head_dim per block; exports as Qwen3ForCausalLM."""
    mlp: str = "swiglu"
    """The MLP (`MLPS`): `swiglu` (Llama's), `relu2_gated` (ReLU² in place of SiLU, the same three matrices;
    exports as Llama with hidden_act relu2) or `relu2` (non-gated up/down, 3/2 the default width so the same
    parameters and FLOPs; no transformers architecture carries it: `lm export` refuses it)."""
    logit_softcap: float | None = None
    """cap * tanh(logits / cap) on the output logits (Gemma 2; nanochat uses 15); None: off. No Llama carries
    it: `lm export` refuses it."""
    z_loss: float = 0.0
    """Coefficient of the z-loss z_loss * mean(logsumexp(logits)^2) added to the training loss (PaLM: 1e-4);
    it keeps the softmax normaliser near 1. Training only: val/loss and the export are without it."""
    zero_init_proj: bool = False
    """Zero-initialise the residual output projections (attention wo, MLP w2), as nanochat and modded-nanogpt
    do: every block starts as the identity. Training only: the export is a plain Llama."""
    doc_mask: bool = False
    """Document masking: attention does not cross an end-of-text token inside a training window; a token
    attends only to earlier tokens of its own document (the end-of-text that closes a document is its last
    token). The end-of-text id comes from the data (`Transformer.eot_id`, set by `LMModule`). Cost: the mask is
    built once per forward from the input ids; on CUDA with flex_attention it is a block mask (blocks wholly
    outside a document are skipped, so it is cheaper than causal attention on short documents, but it needs
    `torch.compile` for speed: lm compiles flex_attention itself), elsewhere a dense (B, T, T) boolean SDPA
    mask, which rules out the flash kernel (memory-efficient or math SDPA instead) and keeps B x T x T bytes
    plus, per block, SDPA's float copy of it (`lm.numbers.memory`). RoPE positions stay absolute in the
    window: rotary attention depends only on the offset between query and key, so a document's outputs do not
    depend on where it starts (up to rounding). The training and validation windows are masked alike, so
    `val/loss` is each document's loss with its own context only; generation and the export see one document
    at a time and are a plain Llama."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise Refused(
                f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; "
                "pick n_head so that head_dim = d_model / n_head is a whole number (64 or 128 is typical)"
            )
        if self.n_head % self.kv_heads:
            raise Refused(
                f"model.n_head={self.n_head} is not a multiple of model.n_kv_head={self.n_kv_head}; "
                "grouped-query attention shares each key/value head among n_head / n_kv_head query heads"
            )
        if self.head_dim % 2:
            raise Refused(f"head_dim={self.head_dim} must be even for rotary embeddings; change model.n_head")
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "max_seq_len", "vocab_multiple"):
            if getattr(self, name) < 1:
                raise Refused(f"model.{name}={getattr(self, name)} must be a positive integer")
        if self.mlp not in MLP_NAMES:
            raise Refused(f"model.mlp={self.mlp!r} is unknown; use one of {', '.join(MLP_NAMES)}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise Refused(
                f"model.logit_softcap={self.logit_softcap} must be > 0 (15 to 30 is usual), or null"
            )
        if not self.z_loss >= 0:
            raise Refused(f"model.z_loss={self.z_loss} must be >= 0 (1e-4 is usual; 0 turns it off)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        gated = math.ceil(int(8 * self.d_model / 3) / self.ffn_multiple) * self.ffn_multiple
        # A non-gated MLP has two matrices, not three: 3/2 the width has the same parameters and FLOPs.
        return math.ceil(3 * gated / 2) if self.mlp == "relu2" else gated


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 squares lose the small activations.
        x_f = x.float()
        x_f = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return x_f.type_as(x) * self.weight


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim), in the rotate-half layout used by Llama in HF."""
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
    )
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)  # (T, E/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, E)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, E) by position; cos/sin are (T, E), or (B, 1, T, E) for packed positions."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).type_as(x)


DocMask = torch.Tensor | BlockMask | None
"""`model.doc_mask`'s attention mask: a dense (B, 1, T, T) boolean one for SDPA, a flex_attention block mask,
or None (plain causal attention)."""


def document_ids(idx_BT: torch.Tensor, eot_id: int) -> torch.Tensor:
    """(B, T) index of each token's document in its window: the count of end-of-text tokens before it (an
    exclusive cumulative sum), so the end-of-text that closes a document stays in it and the next token
    starts the next one."""
    eot_BT = (idx_BT == eot_id).int()
    return eot_BT.cumsum(1) - eot_BT


def dense_doc_mask(doc_BT: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean SDPA mask, True where query t may see key s: s <= t within one document. The
    diagonal is always True, so no row is empty (an empty row would be NaN)."""
    T = doc_BT.shape[1]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=doc_BT.device).tril()
    return ((doc_BT[:, :, None] == doc_BT[:, None, :]) & causal_TT).unsqueeze(1)


@torch.compiler.disable
def flex_doc_mask(doc_BT: torch.Tensor) -> BlockMask:
    """The same mask as `dense_doc_mask` as a flex_attention block mask (128 x 128 blocks, built on the
    device from the mask function; no (T, T) tensor is kept).

    Built outside the compiled graph, so its block tensors enter flex_attention's lowering as fixed inputs:
    created inside a whole-model compile, Inductor fails to lower flex_attention on them (torch 2.11 on an
    H100: "convert FlexibleLayout to FixedLayout first"; 2.13 on a CPU: "No choices to select")."""
    B, T = doc_BT.shape

    def same_document_causal(b, h, q, kv):
        return (doc_BT[b, q] == doc_BT[b, kv]) & (kv <= q)

    return create_block_mask(same_document_causal, B, None, T, T, device=doc_BT.device)


_flex = None


def compiled_flex_attention():
    """flex_attention compiled once: uncompiled it runs a reference that materialises every score. Inside a
    compiled model dynamo inlines it."""
    global _flex
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # gains only (ones): no random draw, so the init of every other weight is unchanged
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[KVCache, int] | None = None,
        doc: DocMask = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTHE = self.wq(x_BTD).view(B, T, self.n_head, self.head_dim)
        k_BTKE = self.wk(x_BTD).view(B, T, self.n_kv_head, self.head_dim)
        if self.qk_norm:  # over each head's E, before RoPE: Qwen3's order, so the export's logits match
            q_BTHE, k_BTKE = self.q_norm(q_BTHE), self.k_norm(k_BTKE)
        q_BHTE, k_BKTE = q_BTHE.transpose(1, 2), k_BTKE.transpose(1, 2)
        v_BKTE = self.wv(x_BTD).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q_BHTE, k_BKTE = self.rotate(q_BHTE, k_BKTE, cos, sin)
        mask, causal = None, True
        if cache is not None:  # generation: attend to every cached position plus the new ones
            kv, layer = cache
            past = kv.pos
            k_BKTE, v_BKTE = kv.update(layer, k_BKTE, v_BKTE)  # now (B, K, past + T, E)
            if past:
                # Query i (absolute position past + i) sees keys 0..past + i.
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x_BTD.device).tril(diagonal=past)
                causal = False
        gqa = self.n_kv_head != self.n_head
        if isinstance(doc, BlockMask):  # model.doc_mask on CUDA: blocks outside every document are skipped
            attend = compiled_flex_attention() if q_BHTE.is_cuda else flex_attention  # CPU: tests only
            y_BHTE = attend(q_BHTE, k_BKTE, v_BKTE, block_mask=doc, enable_gqa=gqa)
            return self.wo(y_BHTE.transpose(1, 2).reshape(B, T, -1))
        if doc is not None:  # model.doc_mask's dense (B, 1, T, T) mask, causal within each document
            mask, causal = doc, False
        # Training: is_causal and no mask, so SDPA may take the flash kernel. q/k/v are (B, H, T, E) views of
        # (B, T, H, E) memory with unit stride in E: flash reads that layout as is (.contiguous() would copy).
        y_BHTE = F.scaled_dot_product_attention(
            q_BHTE,
            k_BKTE,
            v_BKTE,
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=gqa,
        )
        return self.wo(y_BHTE.transpose(1, 2).reshape(B, T, -1))

    def rotate(
        self, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of queries and keys (one call, so a fused kernel can take both: lm.engine.kernels)."""
        return apply_rope(q_BHTE, cos, sin), apply_rope(k_BKTE, cos, sin)


class KVCache:
    """Keys and values of the tokens seen so far, for generation one token at a time.

    Preallocated for `max_seq_len` positions, so a decoding step appends in place instead of concatenating.
    It is not a module and holds no parameters: training never builds one and state-dict keys are untouched.
    """

    def __init__(self, cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (cfg.n_layer, batch, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim)  # (L, B, K, T, E)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0
        """Positions already cached; the model advances it after each forward."""

    def update(self, layer: int, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor):
        """Store one layer's new keys/values at positions pos..pos+T; return all of them so far."""
        end = self.pos + k_BKTE.shape[2]
        self.k[layer, :, :, self.pos : end] = k_BKTE
        self.v[layer, :, :, self.pos : end] = v_BKTE
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class GatedMLP(nn.Module):
    """Llama's MLP, down(act(gate(x)) * up(x)); the subclasses are its activations."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)  # down


class SwiGLU(GatedMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def relu2(x: torch.Tensor) -> torch.Tensor:
    """ReLU squared (Primer; transformers' ACT2FN["relu2"])."""
    return F.relu(x).square()


class GatedReLU2(GatedMLP):
    """ReLU² as the gate's activation (Llama with hidden_act relu2). Not a SwiGLU: Liger's SwiGLU kernel
    (lm.engine.kernels) must not take it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(relu2(self.w1(x)) * self.w3(x))


class ReLU2(nn.Module):
    """The non-gated ReLU² MLP (nanochat, modded-nanogpt): up (w1) and down (w2), no gate."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(relu2(self.w1(x)))


MLPS: dict[str, type[nn.Module]] = {"swiglu": SwiGLU, "relu2_gated": GatedReLU2, "relu2": ReLU2}
"""`model.mlp` -> its module."""


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLPS[cfg.mlp](cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[KVCache, int] | None = None,
        doc: DocMask = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, doc)
        return x + self.mlp(self.mlp_norm(x))


def softcap(logits_BTV: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), in fp32 (the loss upcasts anyway): every logit lies in (-cap, cap). The
    last op is a scalar multiply, which saves nothing for the backward, so `mask_padding` may write in place."""
    return cap * torch.tanh(logits_BTV.float() / cap)


def mask_padding(logits_BTV: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`logits_BTV` with -inf at the padding ids (>= vocab_size, the rows `vocab_multiple` adds): they take
    no probability, so the loss is the one over the real vocabulary, whatever the padding, and equals that of
    a Hugging Face model of exactly `vocab_size` rows. In place on the padding columns only: the matmul keeps
    its aligned width and no second (B, T, V) tensor is made (the head's backward needs not its output)."""
    if logits_BTV.shape[-1] > vocab_size:
        logits_BTV[..., vocab_size:] = float("-inf")
    return logits_BTV


class Transformer(nn.Module):
    """The decoder: token ids (B, T) -> logits (B, T, padded V), -inf at the padding ids."""

    eot_id: int | None = None
    """The end-of-text id `model.doc_mask` splits windows at, set from the data by `LMModule` (a runtime
    setting like `ac_every`, not saved). None: every window is one document (generation, the export's check)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg)
        # Not persistent: derived from the config, so checkpoints stay small and never disagree with it.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.ac_every = 0
        """Activation checkpointing: 0 off, k recomputes every k-th block in the backward pass."""
        self.flex: bool | None = None
        """`model.doc_mask`'s kernel: None flex_attention's block mask on CUDA and the dense SDPA mask
        elsewhere; True or False forces one (tests compare them)."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        residual_std = std / math.sqrt(
            2 * self.cfg.n_layer
        )  # keeps the residual stream's variance flat in depth
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # RMSNorm gains stay at 1
            residual = name.endswith(("wo.weight", "w2.weight"))
            # The draw is made either way, so zero_init_proj changes no other weight's initial values.
            nn.init.normal_(p, mean=0.0, std=residual_std if residual else std)
            if residual and self.cfg.zero_init_proj:
                nn.init.zeros_(p)

    def forward(self, idx_BT: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Logits for every position; with `kv_cache` (generation), idx_BT holds only the new tokens, which
        sit at positions kv_cache.pos onwards, and the cache advances past them."""
        return self.head(self.hidden(idx_BT, kv_cache))

    def head(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Logits (..., padded V) of final hidden states (..., D): the output head, softcap and padding mask.
        Scoring applies it to the few positions it reads (lm.evals.scorer), not to every one."""
        logits = self.lm_head(x_BTD)
        if self.cfg.logit_softcap is not None:
            logits = softcap(logits, self.cfg.logit_softcap)
        return mask_padding(logits, self.cfg.vocab_size)

    def hidden(
        self,
        idx_BT: torch.Tensor,
        kv_cache: KVCache | None = None,
        *,
        pos_BT: torch.Tensor | None = None,
        mask_B1TT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final normalised hidden states (B, T, D), before the output head: what a fused
        linear + cross-entropy loss takes instead of the (B, T, V) logits.

        `pos_BT` and `mask_B1TT` (together) run packed sequences: each token's RoPE position and a boolean
        mask of the keys each query sees (True: attend), so several sequences, or one context and its
        several continuations, share a row (lm.evals.scorer). Not with `kv_cache` or `model.doc_mask`."""
        T = idx_BT.shape[1]
        start = kv_cache.pos if kv_cache is not None else 0
        if pos_BT is not None:
            if mask_B1TT is None or kv_cache is not None:
                raise ValueError("pos_BT needs mask_B1TT, and neither goes with a kv_cache")
            if int(pos_BT.max()) >= self.cfg.max_seq_len:
                raise ValueError(
                    f"position {int(pos_BT.max())} is past model.max_seq_len={self.cfg.max_seq_len}"
                )
            # (B, 1, T, E): broadcast over heads in apply_rope
            cos, sin = self.rope_cos[pos_BT].unsqueeze(1), self.rope_sin[pos_BT].unsqueeze(1)
        else:
            if self.cfg.max_seq_len < start + T:
                raise ValueError(
                    f"sequence of {start + T} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}"
                )
            cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        doc = mask_B1TT if mask_B1TT is not None else self.doc_mask(idx_BT) if kv_cache is None else None
        x_BTD = self.tok_emb(idx_BT)
        for i, block in enumerate(self.blocks):
            if kv_cache is not None:
                x_BTD = block(x_BTD, cos, sin, (kv_cache, i))
            elif self.ac_every and self.training and i % self.ac_every == 0:
                x_BTD = checkpoint(block, x_BTD, cos, sin, None, doc, use_reentrant=False)
            else:
                x_BTD = block(x_BTD, cos, sin, None, doc)
        if kv_cache is not None:
            kv_cache.pos += T
        return self.norm(x_BTD)

    def doc_mask(self, idx_BT: torch.Tensor) -> DocMask:
        """`model.doc_mask`'s mask of these windows, built once for every block; None when it is off or no
        `eot_id` is set (then SDPA runs causal with no mask: today's path, flash on a GPU)."""
        if not self.cfg.doc_mask or self.eot_id is None:
            return None
        doc_BT = document_ids(idx_BT, self.eot_id)
        flex = idx_BT.is_cuda if self.flex is None else self.flex
        return flex_doc_mask(doc_BT) if flex else dense_doc_mask(doc_BT)

    def num_parameters(self, exclude_embedding: bool = False) -> int:
        """Parameter count. `exclude_embedding` drops the input embedding table, a lookup that does no matmul
        work (torchtitan's convention for FLOPs per token); a tied table stays, since the output head uses it."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once
        if exclude_embedding and not self.cfg.tie_embeddings:
            n -= self.tok_emb.weight.numel()
        return n
