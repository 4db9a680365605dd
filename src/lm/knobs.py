"""The speed knobs resolved for one run: kernels (Liger), activation checkpointing (`auto`), SDPA backends.

Each knob is a config group (`precision/`, `activation_checkpointing/`, `kernels/`); this module turns the
group's values into what runs on the device, and refuses what cannot run before anything is built:
`check_kernels` (Liger needs CUDA and the `gpu` extra), `resolve_activation_checkpointing` (the least
checkpointing that fits, found by measured trial steps), `apply_liger` (Liger's kernels in place of the
eager RMSNorm, SwiGLU and RoPE, same parameters and state-dict keys) and `sdpa_backends` (for the log).
"""

from __future__ import annotations

import gc
import importlib
import logging
import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lm.model import Attention, ModelConfig, RMSNorm, SwiGLU, Transformer

log = logging.getLogger(__name__)

LIGER_FIX = "use kernels=eager or kernels=compile"


def check_kernels(liger: bool, cuda: bool) -> None:
    """Refuse `kernels.liger=true` where Liger cannot run, before any data preparation or model build."""
    if not liger:
        return
    if not cuda:
        raise ValueError(
            "kernels.liger=true needs a CUDA GPU: Liger Kernel is written in Triton, which does not run on "
            f"a CPU; {LIGER_FIX}"
        )
    try:
        importlib.import_module("liger_kernel.transformers.functional")
    except ImportError as e:  # not installed, or triton missing/broken underneath it
        raise ValueError(
            f"kernels.liger=true but liger_kernel cannot be imported ({e}); install it with "
            f"pip install -e '.[gpu]' (it brings triton), or {LIGER_FIX}"
        ) from e


# ---------------------------------------------------------------------------------------------------- Liger


def apply_liger(model: Transformer) -> Transformer:
    """Run the model's RMSNorms, SwiGLU MLPs and rotary embeddings on Liger Kernel's Triton kernels.

    Only the instances' forward methods are rebound (as Liger's own model patches do): the modules, their
    parameters and the state-dict keys stay those of the eager model, so checkpoints are interchangeable.
    The fused linear + cross-entropy loss is `fused_linear_cross_entropy`, called by `LMModule.loss`.
    """
    lf = importlib.import_module("liger_kernel.transformers.functional")
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = types.MethodType(_liger_rms_norm(lf), module)
        elif isinstance(module, SwiGLU):
            module.forward = types.MethodType(_liger_swiglu(lf), module)
        elif isinstance(module, Attention):
            module.rotate = types.MethodType(_liger_rotate(lf), module)
    model.liger = True
    return model


def _liger_rms_norm(lf) -> Callable:
    def forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        # casting_mode="llama" is the eager RMSNorm's arithmetic: rstd in fp32, cast back, then the gain.
        # Not in place: the in-place backward overwrites the incoming gradient, which autograd may share.
        return lf.liger_rms_norm(x, self.weight, self.eps, offset=0.0, casting_mode="llama", in_place=False)

    return forward


def _liger_swiglu(lf) -> Callable:
    def forward(self: SwiGLU, x: torch.Tensor) -> torch.Tensor:
        return self.w2(lf.liger_swiglu(self.w1(x), self.w3(x)))

    return forward


def _liger_rotate(lf) -> Callable:
    def rotate(self: Attention, q_BHTE, k_BKTE, cos, sin):
        # Liger's kernel reads the tables in the activations' dtype (the eager path rotates in fp32).
        return lf.liger_rope(q_BHTE, k_BKTE, cos.to(q_BHTE.dtype), sin.to(q_BHTE.dtype))

    return rotate


def fused_linear_cross_entropy(
    hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against targets, computed chunk by chunk by Liger: the
    (N, V) logits tensor (2 GB in fp32 at 16K tokens x 32K vocabulary) is never materialised."""
    lf = importlib.import_module("liger_kernel.transformers.functional")
    return lf.liger_fused_linear_cross_entropy(hidden_ND, weight_VD, targets_N)


def eager_cross_entropy(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """The eager loss, in fp32 (a bf16 log-softmax over 32K classes loses the small probabilities)."""
    return F.cross_entropy(logits_NV.float(), targets_N)


# -------------------------------------------------------------------------------- activation checkpointing


@dataclass
class CheckpointTrial:
    """One measured candidate of `auto`: the stride tried and its peak device memory (None: out of memory)."""

    every: int
    peak_bytes: int | None
    fits: bool


@dataclass
class CheckpointDecision:
    """The resolved activation checkpointing: the block stride to use and why."""

    every: int
    """0 off; k recomputes every k-th block."""
    reason: str
    """One line for the log: configured, or how `auto` chose."""
    trials: list[CheckpointTrial] = field(default_factory=list)
    """The measured candidates of `auto`, in the order tried."""

    @property
    def label(self) -> str:
        return describe_every(self.every)


def describe_every(every: int) -> str:
    return "off" if every == 0 else "every block" if every == 1 else f"1 block in {every}"


def checkpoint_candidates(n_layer: int) -> list[int]:
    """Strides from the least checkpointing to the most: off, then every k-th block for k falling, keeping
    one stride per distinct number of recomputed blocks (ceil(n_layer / k)), down to every block."""
    by_count: dict[int, int] = {}
    for k in range(n_layer, 0, -1):
        by_count.setdefault(math.ceil(n_layer / k), k)  # the largest stride giving each count
    return [0, *(by_count[c] for c in sorted(by_count))]


def resolve_activation_checkpointing(
    every: int,
    auto: bool,
    n_layer: int,
    *,
    probe: Callable[[int], int | None] | None = None,
    budget_bytes: int | None = None,
    headroom: float = 0.1,
) -> CheckpointDecision:
    """The stride to train with.

    Without `auto` the configured `every` stands. With `auto`, `probe(every)` runs one measured trial (the
    real training step at the real micro-batch, on the device) and returns its peak memory in bytes, or
    None when it ran out of memory; candidates go from the least checkpointing to the most
    (`checkpoint_candidates`) and the first whose peak stays within `budget_bytes x (1 - headroom)` wins:
    the fastest setting that fits. Without a probe or a budget (a CPU: no device memory limit) it is off.
    Raises ValueError, naming the fixes, when not even checkpointing every block fits.
    """
    if not auto:
        return CheckpointDecision(every, "configured")
    if probe is None or budget_bytes is None:
        return CheckpointDecision(
            0, "auto: no device memory limit to fit (not training on a CUDA GPU), so checkpointing is off"
        )
    limit = int(budget_bytes * (1.0 - headroom))
    trials: list[CheckpointTrial] = []
    for k in checkpoint_candidates(n_layer):
        peak = probe(k)
        trial = CheckpointTrial(k, peak, peak is not None and peak <= limit)
        trials.append(trial)
        log.info(
            "activation checkpointing auto: %-16s peak %s of %.2f GB allowed -> %s",
            describe_every(k),
            "out of memory" if peak is None else f"{peak / 1e9:.2f} GB",
            limit / 1e9,
            "fits" if trial.fits else "does not fit",
        )
        if trial.fits:
            return CheckpointDecision(
                k,
                f"auto: {describe_every(k)} is the least checkpointing whose trial step peaks within "
                f"{limit / 1e9:.2f} GB ({1 - headroom:.0%} of {budget_bytes / 1e9:.2f} GB free)",
                trials,
            )
    raise ValueError(
        f"activation_checkpointing=auto: not even checkpointing every block fits a training step in "
        f"{limit / 1e9:.2f} GB (peaks: {', '.join(_peak_str(t) for t in trials)}); lower data.batch_size and "
        "raise trainer.accumulate_grad_batches by the same factor (same tokens per step), shorten "
        "data.seq_len, use kernels=liger (no logits tensor), or a GPU with more memory"
    )


def _peak_str(trial: CheckpointTrial) -> str:
    return f"{describe_every(trial.every)} {'OOM' if trial.peak_bytes is None else f'{trial.peak_bytes / 1e9:.2f} GB'}"


def cuda_trial_probe(
    model: ModelConfig,
    *,
    batch_size: int,
    seq_len: int,
    precision: str,
    liger: bool,
    device: torch.device,
) -> Callable[[int], int | None]:
    """A `probe` for `resolve_activation_checkpointing`: two real AdamW steps (fused) of a freshly
    initialised copy of the model at the run's micro-batch, precision and kernels on `device`; returns the
    peak reserved memory (what an out-of-memory error is measured against) or None on OOM.

    Two steps, because AdamW allocates its moments in the first: the second step's forward holds weights,
    moments and activations at once, the steady-state peak. The copy runs eagerly (a compile per candidate
    would take minutes); the headroom covers what compilation and evaluation change. The run's own weights
    are never touched, and everything the trial allocated is released before the next one.
    """
    from lm.module import LMModule  # lm.module imports this module

    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    warmed = False

    def probe(every: int) -> int | None:
        # The first trial in a process reserves ~20% more than every later identical one (5.72 vs 4.73 GiB
        # on an H200, the same allocated peak: experiments/2026-11-23-gpu): one-off library allocations
        # fragment the cache. Measured cold, "off" would look too big and auto would checkpoint for nothing,
        # so the first call runs its trial twice and keeps the second, repeatable, reading.
        nonlocal warmed
        if not warmed:
            warmed = True
            if trial(every) is None:
                return None
        return trial(every)

    def trial(every: int) -> int | None:
        module = optimizer = batch = loss = None
        try:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            with torch.device(device):
                module = LMModule(model, {}, checkpoint_every=every, liger=liger)
            if precision == "bf16-true":
                module.to(torch.bfloat16)
            module.train()
            optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
            for _ in range(2):
                batch = torch.randint(0, model.vocab_size, (batch_size, seq_len + 1), device=device)
                with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
                    loss = module.loss(batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_reserved(device)
        except torch.OutOfMemoryError:
            return None
        finally:
            del module, optimizer, batch, loss
            gc.collect()
            torch.cuda.empty_cache()

    return probe


def free_device_memory(device: torch.device) -> int:
    """Bytes this process could still allocate on the device (other processes' use excluded)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return free


# --------------------------------------------------------------------------------------------------- SDPA


def sdpa_backends() -> dict[str, bool]:
    """Which scaled-dot-product-attention kernels PyTorch may pick on CUDA (flash first when eligible)."""
    b = torch.backends.cuda
    return {
        "flash": b.flash_sdp_enabled(),
        "mem_efficient": b.mem_efficient_sdp_enabled(),
        "cudnn": b.cudnn_sdp_enabled(),
        "math": b.math_sdp_enabled(),
    }
