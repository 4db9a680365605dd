"""An analytic model of one device's peak memory during a training step, before anything is allocated.

peak = parameters + gradients + AdamW moments + autocast weight copies   (static: bytes per parameter)
     + block activations kept for the backward pass                     (bytes per token per block)
     + the output head: final norm, logits and cross-entropy            (bytes per token, ~V wide)
and, on a GPU, a CUDA context plus allocator fragmentation on top of what PyTorch allocates.

Bytes per parameter by precision (AdamW moments take the parameters' dtype, as torch.optim does):
    32-true     4 weights + 4 grads + 8 moments                     = 16
    bf16-mixed  4 fp32 master weights + 4 fp32 grads + 8 moments     = 16, plus 2 for the bf16 copies of the
                matrices that autocast makes in the forward pass and keeps for the backward (16-mixed: same)
    bf16-true   2 + 2 + 4                                            = 8 (no fp32 master copy at all)

Activations per token per block, for this model's block (pre-RMSNorm attention and SwiGLU, residual adds),
with D = d_model, KE = kv heads x head dim, F = SwiGLU width, H = heads. They are the tensors autograd saves,
counted on this exact code with `torch.autograd.graph.saved_tensors_hooks` (tests/numbers/test_memory.py holds the
counter and checks this table against it):
    32-true     32 D + 8 KE + 16 F bytes (8 D + 2 KE + 4 F fp32 values: norm inputs and outputs, q/k before
                and after rotary, v, attention output, the SwiGLU gate, up, SiLU and product)
    bf16-mixed  30 D + 4 KE + 8 F bytes: the residual stream and RMSNorm stay fp32 (the embedding is fp32 and
                RMSNorm upcasts), everything a matmul touches is bf16
    bf16-true   22 D + 4 KE + 8 F bytes: RMSNorm still keeps its fp32 intermediates
plus the attention kernel's softmax statistics (~5 bytes per head). Flash / memory-efficient SDPA (CUDA,
and PyTorch's CPU flash kernel) keeps no T x T score matrix; the math path (`attention="math"`) keeps the
softmax probabilities, 2 x H x T values per token per block. The recipe levers (lm.model) change this:
`model.mlp=relu2` keeps 2 values per F instead of 4 (`RELU2_F_BYTES`), `model.qk_norm` adds its norms'
tensors over the queries and keys (`QK_NORM_BYTES`), the logit softcap and the z-loss add 4 V each to the head.
`model.doc_mask` off a GPU (the dense SDPA mask; on CUDA flex_attention keeps no T x T tensor) adds, per block,
SDPA's float copy of the (B, T, T) boolean mask, which it saves for the backward (T values per token in the
activation dtype, `doc_mask_bytes`); the boolean mask itself is freed with the forward unless activation
checkpointing keeps it for the recompute (T bytes per token).

Activation checkpointing every k blocks keeps only the input of each checkpointed block (the fp32 or bf16
residual stream, D values) and recomputes its activations in the backward pass: one block's worth of them
is alive again at that moment.

The head keeps the final norm's tensors (12 D bytes, 8 D under bf16-true) and the fp32 log-probabilities (4 V); the backward of
the cross-entropy then holds their gradient and the logits' gradient alongside (another 8 V), and a bf16
head adds its bf16 logits gradient (2 V): 12-14 bytes per token per vocabulary entry, the biggest single
term at a 32K vocabulary.

Everything is counted as alive at once (the start of the backward pass, with gradients already allocated as
they are from the second micro-batch of an accumulated step): an upper bound within a few percent.
torch.compile (inductor) fuses elementwise ops and recomputes cheap ones, so a compiled model keeps less
than this eager count; the estimate is conservative for compiled runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from lm.base.exits import Refused
from lm.model import ModelConfig, Transformer

GiB = 2**30

# Per-parameter bytes: (weights, gradients, AdamW moments, autocast copies of the matrices).
STATE_BYTES = {
    "32-true": (4, 4, 8, 0),
    "bf16-mixed": (4, 4, 8, 2),
    "16-mixed": (4, 4, 8, 2),
    "bf16-true": (2, 2, 4, 0),
}
# Per-token per-block activation bytes as (per D, per KE, per F); see the module docstring.
BLOCK_BYTES = {
    "32-true": (32, 8, 16),
    "bf16-mixed": (30, 4, 8),
    "16-mixed": (30, 4, 8),
    "bf16-true": (22, 4, 8),
}
RELU2_F_BYTES = {"32-true": 8, "bf16-mixed": 4, "16-mixed": 4, "bf16-true": 4}
"""Per-F bytes of the non-gated ReLU² MLP (`model.mlp=relu2`): its ReLU output and square, 2 values, where
SwiGLU keeps 4 (its F is 3/2 SwiGLU's, so the MLP keeps 3/4 of SwiGLU's bytes)."""
QK_NORM_BYTES = {"32-true": 8, "bf16-mixed": 6, "16-mixed": 6, "bf16-true": 6}
"""Per query/key value bytes `model.qk_norm` adds: the norm's fp32 input copy and output (fp32 + the cast),
plus an fp32 rstd per head (4 bytes per head). Measured as the table above (tests/model/test_recipe.py)."""
SOFTMAX_STATS_BYTES = 5  # per head: the attention kernel's log-sum-exp (fp32) and bookkeeping
CUDA_CONTEXT_BYTES = int(0.8 * GiB)  # CUDA context + cuBLAS/cuDNN workspaces: outside PyTorch's allocator
FRAGMENTATION = 0.10  # the caching allocator reserves this much beyond the peak it hands out


@dataclass
class MemoryEstimate:
    """One device's peak memory in a training step, by component (bytes)."""

    precision: str
    ac_every: int
    tokens: int
    """Tokens in one micro-batch (batch_size x seq_len): activations scale with it."""
    params: int
    """Parameter count."""
    weights: int
    gradients: int
    optimizer: int
    autocast_copies: int
    activations: int
    """Block activations kept for the backward pass (with activation checkpointing: block inputs plus one
    recomputed block)."""
    head: int
    """Final norm, logits and cross-entropy with their gradients."""
    overhead: int
    """CUDA context and allocator fragmentation (0 on a CPU)."""

    @property
    def allocated(self) -> int:
        """What `torch.cuda.max_memory_allocated` should report."""
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.autocast_copies
            + self.activations
            + self.head
        )

    @property
    def total(self) -> int:
        """What the device must hold: allocated plus overhead."""
        return self.allocated + self.overhead

    def breakdown(self) -> dict[str, float]:
        """GiB per component, for tables and logs."""
        parts = {
            k: v for k, v in asdict(self).items() if k not in ("precision", "ac_every", "tokens", "params")
        }
        return {k: round(v / GiB, 2) for k, v in {**parts, "total": self.total}.items()}

    def summary(self) -> str:
        b = self.breakdown()
        static = b["weights"] + b["gradients"] + b["optimizer"] + b["autocast_copies"]
        return (
            f"{b['total']:.1f} GiB ({static:.1f} states, {b['activations']:.1f} activations, "
            f"{b['head']:.1f} logits/loss, {b['overhead']:.1f} overhead)"
        )


def parameter_count(model: ModelConfig) -> tuple[int, int]:
    """(all parameters, parameters in 2-D matrices), counted on the meta device."""
    with torch.device("meta"):
        net = Transformer(model)
    params = list(net.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.dim() >= 2)


def block_activation_bytes(model: ModelConfig, precision: str, seq_len: int, attention: str = "flash") -> int:
    """Bytes one block keeps per token for its backward pass (no activation checkpointing)."""
    per_d, per_kv, per_f = BLOCK_BYTES[precision]
    if model.mlp == "relu2":
        per_f = RELU2_F_BYTES[precision]
    kv = model.kv_heads * model.head_dim
    n = per_d * model.d_model + per_kv * kv + per_f * model.hidden_dim + SOFTMAX_STATS_BYTES * model.n_head
    if model.qk_norm:
        heads = model.n_head + model.kv_heads
        n += QK_NORM_BYTES[precision] * heads * model.head_dim + 4 * heads
    if attention == "math":  # the materialised softmax probabilities, in the activation dtype
        n += 2 * model.n_head * seq_len * (4 if precision == "32-true" else 2)
    return n


def doc_mask_bytes(model: ModelConfig, precision: str, seq_len: int, cuda: bool, ac_every: int) -> int:
    """Bytes per token `model.doc_mask`'s dense mask keeps for the backward (0 when off, or on CUDA, where
    flex_attention's block mask is a few bytes per 128 x 128 block)."""
    if not model.doc_mask or cuda:
        return 0
    copy = seq_len * (4 if precision == "32-true" else 2)  # SDPA's float copy, in the queries' dtype
    if ac_every <= 0:
        return model.n_layer * copy
    checkpointed = math.ceil(model.n_layer / ac_every)
    return (model.n_layer - checkpointed) * copy + copy + seq_len  # + the recomputed block's, + the bools


def estimate(
    model: ModelConfig,
    *,
    batch_size: int,
    seq_len: int,
    precision: str,
    ac_every: int = 0,
    cuda: bool = True,
    attention: str = "flash",
    shards: int = 1,
) -> MemoryEstimate:
    """Peak memory of one training step of `model` on one device; see the module docstring for the model.

    `precision` is a resolved Lightning precision (not `auto`); `ac_every` as activation_checkpointing.every;
    `cuda` adds the context and fragmentation allowance; `attention` is `flash` (no T x T matrix) or `math`.
    `shards`: FSDP2 over that many devices: the states divided among them, plus two blocks' weights gathered
    whole in the compute dtype (the block computing and the next, prefetched).
    """
    if precision not in STATE_BYTES:
        raise Refused(f"no memory model for precision {precision!r}; use one of {', '.join(STATE_BYTES)}")
    if attention not in ("flash", "math"):
        raise Refused(f"attention={attention!r}: use flash or math")
    n_params, n_matrix = parameter_count(model)
    w, g, o, cast = STATE_BYTES[precision]
    tokens = batch_size * seq_len
    block = block_activation_bytes(model, precision, seq_len, attention)
    layers = model.n_layer
    if ac_every > 0:
        checkpointed = math.ceil(layers / ac_every)  # blocks 0, k, 2k, ...
        residual = 2 if precision == "bf16-true" else 4  # the stream is fp32 unless the weights are bf16
        per_token = (layers - checkpointed) * block + checkpointed * residual * model.d_model + block
    else:
        per_token = layers * block
    per_token += doc_mask_bytes(model, precision, seq_len, cuda, ac_every)
    half_logits = precision != "32-true"
    norm = 8 if precision == "bf16-true" else 12  # the final RMSNorm's fp32 input, output and normalised x
    head_per_token = norm * model.d_model + (12 + (2 if half_logits else 0)) * model.padded_vocab_size
    # The softcap keeps its fp32 tanh output, the z-loss its fp32 logsumexp input: 4 bytes per V each.
    levers = (model.logit_softcap is not None) + (model.z_loss > 0)
    head_per_token += 4 * levers * model.padded_vocab_size
    weights, grads, moments, copies = n_params * w, n_params * g, n_params * o, n_matrix * cast
    if shards > 1:
        gathered = 2 * (n_params - model.padded_vocab_size * model.d_model) // layers * (2 if cast else w)
        weights, grads, moments, copies = (-(-x // shards) for x in (weights, grads, moments, copies))
        weights += gathered
    allocated_states = weights + grads + moments + copies
    activations, head = tokens * per_token, tokens * head_per_token
    overhead = 0
    if cuda:
        overhead = CUDA_CONTEXT_BYTES + int(FRAGMENTATION * (allocated_states + activations + head))
    return MemoryEstimate(
        precision=precision,
        ac_every=ac_every,
        tokens=tokens,
        params=n_params,
        weights=weights,
        gradients=grads,
        optimizer=moments,
        autocast_copies=copies,
        activations=activations,
        head=head,
        overhead=overhead,
    )


def fits(est: MemoryEstimate, device_memory_bytes: float, headroom: float = 0.05) -> bool:
    """Whether the estimate fits a device of this size, keeping `headroom` (a fraction) free."""
    return est.total <= device_memory_bytes * (1.0 - headroom)


@dataclass(frozen=True)
class Workload:
    """One process's training step as the memory model sees it: the model at its micro-batch, in a resolved
    precision, on CUDA or not, with the configured checkpointing stride. The doctor's memory and price checks
    and activation checkpointing's `auto` all ask their questions of it."""

    model: ModelConfig
    batch_size: int
    seq_len: int
    precision: str
    cuda: bool
    every: int = 0
    """The configured activation checkpointing stride (0: off)."""
    headroom: float = 0.05
    """Fraction of device memory kept free when asking whether an estimate fits."""
    shards: int = 1
    """Devices the states are sharded over (trainer=fsdp: the world size; else 1)."""

    def estimate(self, ac_every: int | None = None, batch_size: int | None = None) -> MemoryEstimate:
        """The estimate at the configured stride and micro-batch, or at the ones given (SDPA's flash path)."""
        return estimate(
            self.model,
            batch_size=batch_size or self.batch_size,
            seq_len=self.seq_len,
            precision=self.precision,
            ac_every=self.every if ac_every is None else ac_every,
            cuda=self.cuda,
            shards=self.shards,
        )

    def fits(self, est: MemoryEstimate, memory_gb: float) -> bool:
        """Whether `est` fits a device of `memory_gb` GB, keeping the headroom free."""
        return fits(est, memory_gb * 1e9, self.headroom)
