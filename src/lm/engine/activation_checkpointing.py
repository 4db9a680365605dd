"""Activation checkpointing: which blocks recompute their activations in the backward pass.

`resolve` turns the `activation_checkpointing` group into a block stride: as configured, or for `auto` the
least checkpointing whose measured trial step (`cuda_trial_probe`: the real micro-batch, precision and kernels
on the real GPU) fits the device's free memory. (Model checkpoints, the files a run resumes from, are
`lm.checkpoint.local`'s.)
"""

from __future__ import annotations

import gc
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lm.config import LMConfig
from lm.engine.module import LMModule
from lm.model import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class Trial:
    """One measured candidate of `auto`: the stride tried and its peak device memory (None: out of memory)."""

    every: int
    peak_bytes: int | None
    fits: bool


@dataclass
class Decision:
    """The resolved activation checkpointing: the block stride to use and why."""

    every: int
    """0 off; k recomputes every k-th block."""
    reason: str
    """One line for the log: configured, or how `auto` chose."""
    trials: list[Trial] = field(default_factory=list)
    """The measured candidates of `auto`, in the order tried."""
    pending: bool = False
    """`auto` to be measured later (by rank 0, once the processes are up); `every` is not the stride yet."""

    @property
    def label(self) -> str:
        return "auto" if self.pending else describe(self.every)


def describe(every: int) -> str:
    return "off" if every == 0 else "every block" if every == 1 else f"1 block in {every}"


def candidates(n_layer: int) -> list[int]:
    """Strides from the least checkpointing to the most: off, then every k-th block for k falling, keeping
    one stride per distinct number of recomputed blocks (ceil(n_layer / k)), down to every block."""
    by_count: dict[int, int] = {}
    for k in range(n_layer, 0, -1):
        by_count.setdefault(math.ceil(n_layer / k), k)  # the largest stride giving each count
    return [0, *(by_count[c] for c in sorted(by_count))]


def resolve(
    every: int,
    auto: bool,
    n_layer: int,
    *,
    probe: Callable[[int], int | None] | None = None,
    budget_bytes: int | None = None,
    headroom: float = 0.1,
) -> Decision:
    """The stride to train with.

    Without `auto` the configured `every` stands. With `auto`, `probe(every)` runs one measured trial (the
    real training step at the real micro-batch, on the device) and returns its peak memory in bytes, or
    None when it ran out of memory; candidates go from the least checkpointing to the most
    (`checkpoint_candidates`) and the first whose peak stays within `budget_bytes x (1 - headroom)` wins:
    the fastest setting that fits. Without a probe or a budget (a CPU: no device memory limit) it is off.
    Raises ValueError, naming the fixes, when not even checkpointing every block fits.
    """
    if not auto:
        return Decision(every, "configured")
    if probe is None or budget_bytes is None:
        return Decision(
            0, "auto: no device memory limit to fit (not training on a CUDA GPU), so checkpointing is off"
        )
    limit = int(budget_bytes * (1.0 - headroom))
    trials: list[Trial] = []
    for k in candidates(n_layer):
        peak = probe(k)
        trial = Trial(k, peak, peak is not None and peak <= limit)
        trials.append(trial)
        log.info(
            "activation checkpointing auto: %-16s peak %s of %.2f GB allowed -> %s",
            describe(k),
            "out of memory" if peak is None else f"{peak / 1e9:.2f} GB",
            limit / 1e9,
            "fits" if trial.fits else "does not fit",
        )
        if trial.fits:
            return Decision(
                k,
                f"auto: {describe(k)} is the least checkpointing whose trial step peaks within "
                f"{limit / 1e9:.2f} GB ({1 - headroom:.0%} of {budget_bytes / 1e9:.2f} GB free)",
                trials,
            )
    raise ValueError(
        f"activation_checkpointing=auto: not even checkpointing every block fits a training step in "
        f"{limit / 1e9:.2f} GB (peaks: {', '.join(_peak_str(t) for t in trials)}); lower data.batch_size and "
        "raise trainer.accumulate_grad_batches by the same factor (same tokens per step), shorten "
        "data.seq_len, use kernels=liger (no logits tensor), or a GPU with more memory"
    )


def _peak_str(trial: Trial) -> str:
    return (
        f"{describe(trial.every)} {'OOM' if trial.peak_bytes is None else f'{trial.peak_bytes / 1e9:.2f} GB'}"
    )


def cuda_trial_probe(
    model: ModelConfig,
    *,
    batch_size: int,
    seq_len: int,
    precision: str,
    liger: bool,
    device: torch.device,
) -> Callable[[int], int | None]:
    """A `probe` for `resolve`: two real AdamW steps (fused) of a freshly initialised copy of the model at the run's micro-batch, precision and kernels on `device`; returns the
    peak reserved memory (what an out-of-memory error is measured against) or None on OOM.

    Two steps, because AdamW allocates its moments in the first: the second step's forward holds weights,
    moments and activations at once, the steady-state peak. The copy runs eagerly (a compile per candidate
    would take minutes); the headroom covers what compilation and evaluation change. The run's own weights
    are never touched, and everything the trial allocated is released before the next one.
    """
    warmed = False

    def probe(every: int) -> int | None:
        # The first trial in a process reserves ~20% more than every later identical one (5.72 vs 4.73 GiB
        # on an H200, the same allocated peak: experiments/2026-11-23-gpu): one-off library allocations
        # fragment the cache. Measured cold, "off" would look too big and auto would checkpoint for nothing,
        # so the first call runs its trial twice and keeps the second, repeatable, reading.
        nonlocal warmed
        trial = (model, every, batch_size, seq_len, precision, liger, device)
        if not warmed:
            warmed = True
            if trial_peak(*trial) is None:
                return None
        return trial_peak(*trial)

    return probe


def trial_peak(
    model: ModelConfig, every: int, batch_size: int, seq_len: int, precision: str, liger: bool, device
) -> int | None:
    """Peak reserved bytes of two fused AdamW steps of a fresh copy of the model, or None on OOM; everything
    it allocated is released before it returns."""
    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    module = optimizer = batch = loss = None
    try:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        with torch.device(device):
            module = LMModule(model, {}, ac_every=every, liger=liger)
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


def free_device_memory(device: torch.device) -> int:
    """Bytes this process could still allocate on the device: other processes' use excluded, and capped by
    this process's `set_per_process_memory_fraction` (`lm bench`'s bench.memory_limit_gb)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    return allowed_bytes(free, total, fraction, torch.cuda.memory_reserved(device))


def allowed_bytes(free: int, total: int, fraction: float, reserved: int) -> int:
    """What a process may still allocate: the device's free memory, but no more than its memory fraction of
    the device less what its caching allocator already holds (`mem_get_info` knows nothing of the fraction)."""
    return max(0, min(free, int(fraction * total) - reserved))


def decide(cfg: LMConfig, precision: str, cuda: bool) -> Decision:
    """The block stride for a composed config: as configured, or for `auto` measured on this process's GPU
    (after any memory cap is in place, so the trials see what the run will have)."""
    ac = cfg.activation_checkpointing
    probe = budget = None
    if ac.auto and cuda:
        # Lightning has not picked the device yet: under DDP each local rank trains on GPU LOCAL_RANK.
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        budget = free_device_memory(gpu)
        probe = cuda_trial_probe(
            cfg.model,
            batch_size=cfg.data.batch_size,
            seq_len=cfg.data.seq_len,
            precision=precision,
            liger=cfg.kernels.liger,
            device=gpu,
        )
    return resolve(
        ac.every, ac.auto, cfg.model.n_layer, probe=probe, budget_bytes=budget, headroom=ac.headroom
    )
