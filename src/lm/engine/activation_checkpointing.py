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

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.checkpoint.local import gib
from lm.config import ActivationCheckpointingConfig, GpuConfig
from lm.engine.module import LMModule
from lm.model import ModelConfig
from lm.numbers.memory import MemoryEstimate, Workload

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
    free_memory_reserve: float = 0.1,
) -> Decision:
    """The stride to train with.

    Without `auto` the configured `every` stands. With `auto`, `probe(every)` runs one measured trial (the
    real training step at the real micro-batch, on the device) and returns its peak memory in bytes, or
    None when it ran out of memory; candidates go from the least checkpointing to the most
    (`checkpoint_candidates`) and the first whose peak stays within `budget_bytes x (1 - free_memory_reserve)` wins:
    the fastest setting that fits. Without a probe or a budget (a CPU: no device memory limit) it is off.
    Raises ValueError, naming the fixes, when not even checkpointing every block fits.
    """
    if not auto:
        return Decision(every, "configured")
    if probe is None or budget_bytes is None:
        return Decision(
            0, "auto: no device memory limit to fit (not training on a CUDA GPU), so checkpointing is off"
        )
    limit = int(budget_bytes * (1.0 - free_memory_reserve))
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
                f"{limit / 1e9:.2f} GB ({1 - free_memory_reserve:.0%} of {budget_bytes / 1e9:.2f} GB free)",
                trials,
            )
    raise Refused(
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
    would take minutes); the reserve covers what compilation and evaluation change. The run's own weights
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
            module = LMModule(model, {}, ac_every=every, liger=liger, eot_id=0)  # doc_mask: the mask's cost
        if precision == "bf16-true":
            module.to(torch.bfloat16)
        module.train()
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
        for _ in range(2):
            batch = torch.randint(0, model.vocab_size, (batch_size, seq_len + 1), device=device)
            with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
                loss = module.objective(batch)[0]  # the training step's graph, a z-loss included
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


def decide(ac: ActivationCheckpointingConfig, work: Workload, liger: bool) -> Decision:
    """The block stride for a run: as configured, or for `auto` measured on this process's GPU (after any
    memory cap is in place, so the trials see what the run will have)."""
    probe = budget = None
    if ac.auto and work.cuda:
        # Lightning has not picked the device yet: under DDP each local rank trains on GPU LOCAL_RANK.
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        budget = free_device_memory(gpu)
        probe = cuda_trial_probe(
            work.model,
            batch_size=work.batch_size,
            seq_len=work.seq_len,
            precision=work.precision,
            liger=liger,
            device=gpu,
        )
    return resolve(
        ac.every,
        ac.auto,
        work.model.n_layer,
        probe=probe,
        budget_bytes=budget,
        free_memory_reserve=ac.free_memory_reserve,
    )


# -- preflight: the doctor's memory check (lm.run.doctor runs it) ------------------------------------------


def least_checkpointing(work: Workload, memory_gb: float) -> tuple[int, MemoryEstimate] | None:
    """The estimate's least activation checkpointing that fits this device (off first, every block last),
    with its estimate; None when not even every block checkpointed fits."""
    for k in candidates(work.model.n_layer):
        est = work.estimate(ac_every=k)
        if work.fits(est, memory_gb):
            return k, est
    return None


def smaller_micro_batch(batch: int, accumulate: int) -> tuple[int, int] | None:
    """The largest smaller micro-batch that keeps the tokens per optimizer step exact, with its accumulation
    (8 -> 4 x 2, 6 -> 3 x 2, 5 -> 1 x 5), or None at a micro-batch of 1."""
    smaller = next((d for d in range(batch // 2, 0, -1) if batch % d == 0), None)
    if smaller is None:
        return None
    return smaller, accumulate * (batch // smaller)


def memory_findings(work: Workload, auto: bool, accumulate: int, gpu: GpuConfig) -> list[Finding]:
    """Activation checkpointing on while the run would fit without it; a run that does not fit at all."""
    est = work.estimate()
    if not work.cuda or not gpu.memory_gb:
        return host_memory_findings(work, est)
    mem = gpu.memory_gb
    device = f"{mem:g} GB {gpu.name}"
    every = work.every
    if auto:
        # `auto` measures at start; the model says where its search should end up, or that it cannot.
        if least := least_checkpointing(work, mem):
            what = f"auto: the estimate expects {describe(least[0])} (~{gib(least[1].total)} of {device})"
            return [Finding("activation_checkpointing", "ok", f"{what}; measured at start")]
        every, est = 1, work.estimate(ac_every=1)  # nothing fits even with every block checkpointed
    off = work.estimate(ac_every=0)
    if every and work.fits(off, mem):
        return [
            Finding(
                "activation_checkpointing",
                "warn",
                f"on (every {every}), but the run fits without it: ~{gib(off.total)} of {device}",
                "+18-22% tokens/s (seed A100: 24.0K -> 28.3K; 1b on an H100 with compile: 60.4K -> 73.4K)",
                "activation_checkpointing=off",
            )
        ]
    if work.fits(est, mem):
        return [Finding("memory", "ok", f"~{est.summary()} of {device}")]
    on = work.estimate(ac_every=1)
    if not every and work.fits(on, mem):
        return [needs_checkpointing(work, est, accumulate, mem, device)]
    smaller = smaller_micro_batch(work.batch_size, accumulate)
    fix = "a GPU with more memory, or a smaller model"
    if smaller:
        fix = f"data.batch_size={smaller[0]} trainer.accumulate_grad_batches={smaller[1]} (same tokens per step)"
        fix += " activation_checkpointing=on" if not every else ""
    what = (
        f"~{gib(on.total if not every else est.total)} estimated does not fit {device} even with activation"
    )
    return [
        Finding("memory", "error", f"{what} checkpointing ({est.summary()})", "a run that starts at all", fix)
    ]


def host_memory_findings(work: Workload, est: MemoryEstimate) -> list[Finding]:
    """A CPU run (or an uncatalogued device): the estimate against this machine's RAM."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    if ram and est.total > ram:
        return [
            Finding(
                "memory",
                "warn",
                f"~{gib(est.total)} estimated, more than this machine's {gib(ram)} of RAM",
                "no swapping",
                f"data.batch_size={max(1, work.batch_size // 2)}",
            )
        ]
    return [Finding("memory", "ok", f"~{est.summary()} estimated on the CPU")]


def needs_checkpointing(
    work: Workload, est: MemoryEstimate, accumulate: int, memory_gb: float, device: str
) -> Finding:
    """A run that fits only with recompute: the least that fits (`auto` measures it at start, and the
    estimate errs high, so the measurement may need even less); a smaller micro-batch without recompute may
    be cheaper still."""
    least, least_est = least_checkpointing(work, memory_gb)  # not off (it does not fit), at most every block
    what = (
        f"~{gib(est.total)} estimated does not fit {device} without activation checkpointing; the "
        f"estimate expects {describe(least)} to fit (~{gib(least_est.total)})"
    )
    smaller = smaller_micro_batch(work.batch_size, accumulate)
    if smaller and work.fits(work.estimate(ac_every=0, batch_size=smaller[0]), memory_gb):
        what += (
            f"; data.batch_size={smaller[0]} trainer.accumulate_grad_batches={smaller[1]} without "
            f"checkpointing also fits (same tokens per step): `lm bench "
            f"data.batch_size={work.batch_size},{smaller[0]} activation_checkpointing=auto,off` "
            "says which is cheaper"
        )
    return Finding(
        "memory",
        "warn",
        what,
        "no out-of-memory crash at the least recompute (checkpointing every block costs 18-22% "
        "tokens/s; auto measures the least that fits at start)",
        "activation_checkpointing=auto",
    )
