"""The preflight doctor: forgotten free optimizations and plan problems, found before a cent is spent.

Each check is a small function of a `Target` (the config plus the device it will run on, resolved) that
returns findings: a level (ok / warn / error), what it saw, the expected gain of fixing it and the fix as a
Hydra override. `lm doctor` prints them as a table; `lm.run.train.main` runs them first and refuses the run on an
error (or on a warning with `doctor.strict=true`).

Gains quote the seed articles where they measured one (experiments and docs name which); elsewhere they are
stated estimates. GPU-only advice (compile, TF32, bf16, workers) stays silent on a CPU run: a CPU smoke test
is not worth nagging about.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

from lm.checkpoint.local import checkpoint_space, estimate_checkpoint_bytes, gib
from lm.config import GpuConfig, LMConfig, conf_dir
from lm.data import LMDataModule
from lm.data.dataset import TokenWindows
from lm.data.manifest import MANIFEST, load_manifest, prepared_folder, shard_paths
from lm.data.mixture import plan_sources
from lm.engine import activation_checkpointing as ac
from lm.engine import optim, runtime
from lm.engine.harness import missing_harness
from lm.numbers import cost, memory, run_plan
from lm.store import rundir
from lm.store.bench_file import measured_mfu

log = logging.getLogger(__name__)

LEVELS = ("ok", "warn", "error")
AC_SLOWDOWN = 1 / 1.18  # seed 000/002: checkpointing off took the A100 from 24.0K to 28.3K tokens/s (+18%)


@dataclass
class Finding:
    """One line of the doctor's table."""

    check: str
    level: str
    what: str
    gain: str = ""
    """Expected benefit of the fix (measured in a seed where it says so, else an estimate)."""
    fix: str = ""
    """The Hydra override(s) that fix it."""


@dataclass
class Target:
    """What the run will execute on, resolved: the doctor's inputs beside the config."""

    cfg: LMConfig
    gpu: GpuConfig
    """Catalog entry of the device (the `cpu` entry on a CPU)."""
    cuda: bool
    """Training on an NVIDIA GPU (or planning for one: `lm doctor gpu=a100_80gb` on a laptop)."""
    precision: str
    """Resolved Lightning precision (never `auto`)."""
    run_dir: Path
    catalog: dict[str, GpuConfig] = field(default_factory=dict)
    """Every catalogued GPU, for the $/token comparison."""

    @property
    def memory_bytes(self) -> float | None:
        return self.gpu.memory_gb * 1e9 if self.gpu.memory_gb else None

    @functools.cached_property
    def n_params(self) -> int:
        """The model's parameter count (counted once on the meta device; three checks read it)."""
        return memory.parameter_count(self.cfg.model)[0]


def estimate_for(
    t: Target, ac_every: int | None = None, precision: str | None = None, batch_size: int | None = None
) -> memory.MemoryEstimate:
    """The memory model for this run's micro-batch (SDPA's flash path on CUDA, as the model uses there)."""
    c = t.cfg
    return memory.estimate(
        c.model,
        batch_size=batch_size or c.data.batch_size,
        seq_len=c.data.seq_len,
        precision=precision or t.precision,
        ac_every=c.activation_checkpointing.every if ac_every is None else ac_every,
        cuda=t.cuda,
    )


def least_checkpointing(t: Target) -> tuple[int, memory.MemoryEstimate] | None:
    """The estimate's least activation checkpointing that fits this device (off first, every block last),
    with its estimate; None when not even every block checkpointed fits."""
    for k in ac.candidates(t.cfg.model.n_layer):
        est = estimate_for(t, ac_every=k)
        if fits(t, est):
            return k, est
    return None


def smaller_micro_batch(t: Target) -> tuple[int, int] | None:
    """The largest smaller micro-batch that keeps the tokens per optimizer step exact, with its accumulation
    (8 -> 4 x 2, 6 -> 3 x 2, 5 -> 1 x 5), or None at a micro-batch of 1."""
    batch = t.cfg.data.batch_size
    smaller = next((d for d in range(batch // 2, 0, -1) if batch % d == 0), None)
    if smaller is None:
        return None
    return smaller, t.cfg.trainer.accumulate_grad_batches * (batch // smaller)


def check_memory(t: Target) -> list[Finding]:
    """Activation checkpointing on while the run would fit without it; a run that does not fit at all."""
    est = estimate_for(t)
    if not t.cuda or t.memory_bytes is None:
        return check_host_memory(t, est)
    device = f"{t.gpu.memory_gb:g} GB {t.gpu.name}"
    every = t.cfg.activation_checkpointing.every
    if t.cfg.activation_checkpointing.auto:
        # `auto` measures at start; the model says where its search should end up, or that it cannot.
        if least := least_checkpointing(t):
            what = f"auto: the estimate expects {ac.describe(least[0])} (~{gib(least[1].total)} of {device})"
            return [Finding("activation_checkpointing", "ok", f"{what}; measured at start")]
        every, est = 1, estimate_for(t, ac_every=1)  # nothing fits even with every block checkpointed
    off = estimate_for(t, ac_every=0)
    if every and fits(t, off):
        return [
            Finding(
                "activation_checkpointing",
                "warn",
                f"on (every {every}), but the run fits without it: ~{gib(off.total)} of {device}",
                "+18-22% tokens/s (seed A100: 24.0K -> 28.3K; 1b on an H100 with compile: 60.4K -> 73.4K)",
                "activation_checkpointing=off",
            )
        ]
    if fits(t, est):
        return [Finding("memory", "ok", f"~{est.summary()} of {device}")]
    on = estimate_for(t, ac_every=1)
    if not every and fits(t, on):
        return [needs_checkpointing(t, est, device)]
    smaller = smaller_micro_batch(t)
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


def fits(t: Target, est: memory.MemoryEstimate) -> bool:
    return memory.fits(est, t.memory_bytes, t.cfg.doctor.headroom)


def check_host_memory(t: Target, est: memory.MemoryEstimate) -> list[Finding]:
    """A CPU run (or an uncatalogued device): the estimate against this machine's RAM."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    if ram and est.total > ram:
        return [
            Finding(
                "memory",
                "warn",
                f"~{gib(est.total)} estimated, more than this machine's {gib(ram)} of RAM",
                "no swapping",
                f"data.batch_size={max(1, t.cfg.data.batch_size // 2)}",
            )
        ]
    return [Finding("memory", "ok", f"~{est.summary()} estimated on the CPU")]


def needs_checkpointing(t: Target, est: memory.MemoryEstimate, device: str) -> Finding:
    """A run that fits only with recompute: the least that fits (`auto` measures it at start, and the
    estimate errs high, so the measurement may need even less); a smaller micro-batch without recompute may
    be cheaper still."""
    least, least_est = least_checkpointing(t)  # not off (it does not fit), at most every block
    what = (
        f"~{gib(est.total)} estimated does not fit {device} without activation checkpointing; the "
        f"estimate expects {ac.describe(least)} to fit (~{gib(least_est.total)})"
    )
    smaller = smaller_micro_batch(t)
    if smaller and fits(t, estimate_for(t, ac_every=0, batch_size=smaller[0])):
        what += (
            f"; data.batch_size={smaller[0]} trainer.accumulate_grad_batches={smaller[1]} without "
            f"checkpointing also fits (same tokens per step): `lm bench "
            f"data.batch_size={t.cfg.data.batch_size},{smaller[0]} activation_checkpointing=auto,off` "
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


def check_precision(t: Target) -> list[Finding]:
    """fp32 on a GPU; TF32 off."""
    if not t.cuda:
        return []
    out = []
    if t.precision == "32-true":
        ratio = (t.gpu.peak_bf16_tflops or 0) / (t.gpu.peak_tf32_tflops or math.inf)
        out.append(
            Finding(
                "precision",
                "warn",
                "fp32 training on a GPU (precision 32-true)",
                f"~2x+ tokens/s, half the activation memory (bf16 peak {ratio:.1f}x TF32's here; "
                "seed 001: 2-8x over fp32)",
                "precision=bf16",
            )
        )
    else:
        out.append(Finding("precision", "ok", t.precision))
    if not t.cfg.precision.tf32:
        big = t.precision == "32-true"
        out.append(
            Finding(
                "tf32",
                "warn",
                "TF32 matmuls are off",
                "up to ~8x on fp32 matmuls (A100: 156 vs 19.5 TFLOP/s)"
                if big
                else "small (fp32 matmuls outside autocast); free (seed 000)",
                "precision.tf32=true",
            )
        )
    return out


def check_kernels(t: Target) -> list[Finding]:
    """torch.compile off on a GPU; Liger beside compile, which measured slower than compile alone.

    Gains are `lm bench` of the 1b model on an H100 (experiments/2026-11-23-gpu): eager 47.3K, Liger 65.3K,
    Liger + compile 65.0K, compile 73.4K tokens/s. Liger's remaining gain is memory (no logits tensor), so
    the Liger + compile warning says to keep it only where compile alone does not fit."""
    if not t.cuda:
        return []
    liger = t.cfg.kernels.liger
    if t.cfg.kernels.compile is False:
        gain = (
            "+12% tokens/s over Liger alone (1b on an H100: 65.3K -> 73.4K)"
            if liger
            else "+55% tokens/s, 20% less memory (1b on an H100: 47.3K -> 73.4K tok/s, 58 -> 46 GB)"
        )
        return [Finding("compile", "warn", "torch.compile is off on a GPU", gain, "kernels=compile")]
    if liger:
        return [
            Finding(
                "compile",
                "warn",
                "Liger kernels beside torch.compile: slower than compile alone where measured",
                "+13% tokens/s (1b on an H100: 65.0K -> 73.4K); keep Liger only if compile alone does not "
                "fit: lm bench kernels=compile,liger_compile",
                "kernels=compile",
            )
        ]
    return [Finding("compile", "ok", "torch.compile on")]


def check_workers(t: Target) -> list[Finding]:
    """num_workers=0 on a GPU stalls the device while the next batch loads."""
    if not t.cuda:
        return []
    if t.cfg.data.num_workers == 0:
        n = max(1, min(4, (os.cpu_count() or 2) - 1))
        return [
            Finding(
                "num_workers",
                "warn",
                "data.num_workers=0: the GPU idles while each batch loads",
                "seed 000: 'massive' (est. 5-30% tokens/s)",
                f"data.num_workers={n}",
            )
        ]
    return [Finding("num_workers", "ok", f"{t.cfg.data.num_workers} DataLoader workers")]


def check_vocab(t: Target) -> list[Finding]:
    """An embedding/lm_head width that is not a multiple of 64 (misaligned tensor-core shapes)."""
    m = t.cfg.model
    if m.padded_vocab_size % 64:
        padded = math.ceil(m.vocab_size / 64) * 64
        return [
            Finding(
                "vocab",
                "warn",
                f"vocabulary width {m.padded_vocab_size} is not a multiple of 64",
                f"est. up to ~25% on the lm_head matmul (nanoGPT 50257 -> 50304); pads to {padded}",
                "model.vocab_multiple=64",
            )
        ]
    return [Finding("vocab", "ok", f"vocabulary padded to {m.padded_vocab_size}")]


def check_disk(t: Target) -> list[Finding]:
    """Free space for keep_last + 1 checkpoints (the guard's own arithmetic, in lm.checkpoint.local)."""
    n_params = t.n_params
    ckpt = estimate_checkpoint_bytes(n_params)
    keep, need, free = checkpoint_space(t.run_dir / "checkpoints", ckpt, t.cfg.checkpoint.keep_last)
    what = f"{keep}+1 checkpoints of ~{gib(ckpt)} need {gib(max(need, 0))}; {gib(free)} free at {t.run_dir}"
    if need > free:
        return [
            Finding(
                "disk",
                "error",
                what,
                "no crash at the first save",
                f"checkpoint.keep_last={max(1, int(free / (ckpt * 1.05)) - 1)} or run.root=<bigger disk>",
            )
        ]
    return [Finding("disk", "ok", what)]


def prepared_dataset(cfg: LMConfig):
    """The training split's Dataset if the data is prepared already, else None. Preflight stays cheap and
    offline: it never tokenizes, and never lists a Hugging Face dataset (`prepared_folder`)."""
    folder = prepared_folder(cfg.data)
    if folder is None or not (folder / MANIFEST).is_file():
        return None
    manifest = load_manifest(folder)
    return TokenWindows(shard_paths(folder, manifest, "train"), cfg.data.seq_len, manifest["dtype"])


def check_pickles(t: Target, dataset=None) -> list[Finding]:
    """What the DataLoader sends to its worker processes must pickle (and still work once unpickled)."""
    if t.cfg.data.num_workers == 0:
        return []
    if dataset is None:
        try:
            dataset = prepared_dataset(t.cfg)
        except (OSError, ValueError) as e:  # a data problem, not a pickling one: preparation reports it
            log.debug("doctor: prepared dataset not located (%s)", e)
    try:
        if dataset is None:  # not prepared yet: the data module is what carries the config to them
            pickle.loads(pickle.dumps(LMDataModule(t.cfg.data)))
            return [Finding("pickle", "ok", "data module pickles (data not prepared yet: dataset unchecked)")]
        copy = pickle.loads(pickle.dumps(dataset))
        if len(copy):
            copy[0]  # a worker's first read: re-opens the shards from the unpickled paths
        return [Finding("pickle", "ok", f"dataset pickles for {t.cfg.data.num_workers} workers")]
    except Exception as e:  # anything pickling raises: lambdas, open handles, locks
        return [
            Finding(
                "pickle",
                "error",
                f"the dataset cannot be sent to worker processes: {type(e).__name__}: {e}",
                "no crash in the first DataLoader worker",
                "data.num_workers=0 (slow) or make the dataset picklable",
            )
        ]


def check_plan(t: Target) -> list[Finding]:
    """The plan's tokens per parameter against Chinchilla's ~20."""
    n_params = t.n_params
    end = run_plan.plan_end(t.cfg)
    ratio = end.tokens / n_params
    what = f"{end.tokens:,} tokens / {n_params:,} params = {ratio:.1f} tokens/param ({end.source}); Chinchilla ~20"
    optimal = run_plan.chinchilla_tokens(n_params)
    if t.cuda and ratio < run_plan.CHINCHILLA_TOKENS_PER_PARAM / 2:
        return [
            Finding(
                "tokens/param",
                "warn",
                what,
                "a lower loss per $: train longer, or a smaller model for this compute (Hoffmann et al. 2022)",
                f"trainer.max_steps={math.ceil(optimal / run_plan.tokens_per_step(t.cfg))}",
            )
        ]
    return [Finding("tokens/param", "ok", what)]


def check_mixture(t: Target) -> list[Finding]:
    """Per source of data.mixture: tokens held against tokens the plan draws (weight x plan), the epochs that
    makes, and where a max_epochs cap will stop the run or leave the source out (lm.data.mixture)."""
    data = t.cfg.data
    if not data.mixture:
        return []
    end = run_plan.plan_end(t.cfg)
    per_step = run_plan.tokens_per_step(t.cfg) // data.seq_len
    steps = end.steps if end.steps is not None else math.ceil(end.tokens / (per_step * data.seq_len))
    rows = plan_sources(data, t.cfg.phases.phases, per_step, steps)
    if rows is None:
        return [
            Finding(
                "mixture", "ok", f"{len(data.mixture)} sources, not all prepared yet: checked once they are"
            )
        ]
    findings = []
    for row in rows:
        what = (
            f"{row.name}: {row.tokens:,} tokens held, the plan draws {row.planned:,} "
            f"({row.planned / max(end.tokens, 1):.0%} of {end.tokens:,}) = {row.epochs:.2f} epochs"
        )
        if row.capped_at is not None:
            outcome = "the run stops" if data.on_exhausted == "stop" else "the others take its weight"
            fix = f"raise its max_epochs, lower its weight{' or data.on_exhausted=renormalise' if data.on_exhausted == 'stop' else ''}"
            findings.append(
                Finding(
                    "mixture",
                    "warn",
                    f"{what}; its max_epochs cap is met at step {row.capped_at:,}: {outcome}",
                    "the plan as written",
                    fix,
                )
            )
        elif row.epochs > 1:
            findings.append(
                Finding(
                    "mixture",
                    "warn",
                    f"{what}: repeated data",
                    "fresh tokens",
                    "give it more data, lower its weight or set its max_epochs",
                )
            )
        else:
            findings.append(Finding("mixture", "ok", what))
    return findings


def usd_per_btok(gpu: GpuConfig, t: Target, fpt: float, mfu: float, pricing: str) -> tuple[float, str] | None:
    """Estimated $/10^9 tokens of this run on `gpu` (with checkpointing if it only fits that way), or None
    when the catalog lacks its price, peak or memory, or the run does not fit it. A GPU without a spot price
    is priced on demand (`cost.catalog_price`: an upper bound), and the note says so."""
    found = cost.catalog_price(gpu, pricing)
    peak = cost.peak_flops(gpu, t.precision, t.cfg.precision.tf32)
    if not found or not found[0] or not peak or not gpu.memory_gb:
        return None
    price, priced_at = found
    slow, note = 1.0, "" if priced_at == pricing else f" ({priced_at}: no {pricing} price)"
    if not memory.fits(estimate_for(t, ac_every=0), gpu.memory_gb * 1e9, t.cfg.doctor.headroom):
        if not memory.fits(estimate_for(t, ac_every=1), gpu.memory_gb * 1e9, t.cfg.doctor.headroom):
            return None
        slow, note = AC_SLOWDOWN, f" with activation checkpointing{note}"
    tokens_per_sec = peak * mfu * slow / fpt
    return cost.usd_per_billion_tokens(tokens_per_sec, price, 1), note


def check_price(t: Target) -> list[Finding]:
    """This GPU's $/token against the catalog's cheapest GPU that fits the model: the others at
    doctor.assumed_mfu, this one at the MFU `lm bench` measured on it (bench.out_dir/bench.json) if any."""
    if not t.cuda or not t.catalog:
        return []
    pricing = t.cfg.cost.pricing
    fpt = cost.flops_per_token(t.cfg.model, t.cfg.data.seq_len)
    mfu = t.cfg.doctor.assumed_mfu
    n_params = t.n_params
    bench_mfu = measured_mfu(Path(t.cfg.bench.out_dir), t.gpu.name, t.cfg.model, n_params)
    # A measured MFU prices this GPU better; the others stay at the assumed one (no bench ran on them).
    mine = usd_per_btok(t.gpu, t, fpt, bench_mfu or mfu, pricing)
    if t.cfg.cost.price_per_hour is not None and mine is not None:  # the user's own rate
        peak = cost.peak_flops(t.gpu, t.precision, t.cfg.precision.tf32)
        rate = peak * (bench_mfu or mfu) * (AC_SLOWDOWN if "checkpointing" in mine[1] else 1.0) / fpt
        mine = (cost.usd_per_billion_tokens(rate, t.cfg.cost.price_per_hour, 1), mine[1])
    options = {name: r for name, g in t.catalog.items() if (r := usd_per_btok(g, t, fpt, mfu, pricing))}
    if mine is None or not options:
        return [
            Finding("$/token", "ok", f"no {pricing} price, peak or memory for gpu={t.gpu.name}: not compared")
        ]
    options[t.gpu.name] = mine
    best = min(options, key=lambda k: options[k][0])
    basis = f"MFU {bench_mfu:.0%} measured by lm bench" if bench_mfu else f"MFU {mfu:.0%} assumed"
    here = f"~${mine[0]:.2f}/Btok on {t.gpu.name}{mine[1]} ({pricing}, {basis})"
    if options[best][0] < 0.9 * mine[0] and best != t.gpu.name:
        saving = 1 - options[best][0] / mine[0]
        return [
            Finding(
                "$/token",
                "warn",
                f"{here}; {best} ~${options[best][0]:.2f}/Btok{options[best][1]}",
                f"-{saving:.0%} $/token at the same MFU, unmeasured there: check availability, then "
                f"`lm bench` on it and `lm bench --compare` (seed 000)",
                f"gpu={best} (rent one)",
            )
        ]
    return [Finding("$/token", "ok", f"{here}: the catalog's cheapest that fits")]


def check_evals(t: Target) -> list[Finding]:
    """Benchmarks at milestones (`evals=`) need lm-eval installed: refused now, not at the first phase
    boundary hours in. (Task names are checked by the callback at setup, before the first step: knowing
    lm-eval's registry means indexing thousands of YAMLs.)"""
    evals = t.cfg.evals
    if not evals.tasks:
        return []
    problem = missing_harness()
    if problem is None and evals.include_path and not Path(evals.include_path).expanduser().is_dir():
        problem = f"evals.include_path={evals.include_path} is not a folder of task YAMLs"
    if problem:
        return [Finding("evals", "error", problem, fix="evals=off, or the fix above")]
    return [Finding("evals", "ok", f"benchmarks at milestones: {', '.join(evals.tasks)}")]


def check_optimizer(t: Target) -> list[Finding]:
    """`optim=muon`: which parameters Muon takes and its LR convention (lm.engine.optim), so a surprise (a head left
    to Muon, a Keller-scale LR under Moonlight's scale) shows before the run. AdamW alone needs no line."""
    if t.cfg.optim.name == "adamw":
        return []
    return [Finding("optimizer", "ok", optim.describe(t.cfg.model, t.cfg.optim))]


CHECKS: list[Callable[[Target], list[Finding]]] = [
    check_memory,
    check_precision,
    check_kernels,
    check_workers,
    check_vocab,
    check_disk,
    check_pickles,
    check_plan,
    check_mixture,
    check_price,
    check_evals,
    check_optimizer,
]


def diagnose(t: Target, checks: list[Callable[[Target], list[Finding]]] | None = None) -> list[Finding]:
    """Every check's findings, in order."""
    return [f for check in checks or CHECKS for f in check(t)]


def table(findings: list[Finding], strict: bool = False) -> str:
    """One line per finding: level, check, what, gain, fix; then the fixes as one command line."""
    rows = [(level_of(f, strict).upper(), f.check, f.what, f.gain, f.fix) for f in findings]
    widths = [max(len(r[i]) for r in rows) for i in range(2)] if rows else [0, 0]
    lines = []
    for level, check, what, gain, fix in rows:
        line = f"{level:<{widths[0]}}  {check:<{widths[1]}}  {what}"
        if gain:
            line += f"  | gain: {gain}"
        if fix:
            line += f"  | fix: {fix}"
        lines.append(line)
    # Only plain overrides go on the command line; fixes with alternatives or placeholders stay in the table.
    fixes = [f.fix for f in findings if f.level != "ok" and f.fix and not any(c in f.fix for c in "<( ")]
    if fixes:
        lines.append(f"apply the fixes: python train.py [your overrides] {' '.join(fixes)}")
    return "\n".join(lines)


def level_of(f: Finding, strict: bool) -> str:
    return "error" if strict and f.level == "warn" else f.level


def preflight(t: Target, strict: bool | None = None) -> list[Finding]:
    """Diagnose, log the table, and refuse (ValueError) on any error (any warning when strict)."""
    strict = t.cfg.doctor.strict if strict is None else strict
    findings = diagnose(t)
    text = table(findings, strict)
    errors = [f for f in findings if level_of(f, strict) == "error"]
    if errors:
        raise ValueError(
            f"the doctor refuses this run ({len(errors)} error(s)"
            + (", doctor.strict=true" if strict else "")
            + f"):\n{text}\nfix them (the overrides above) or, for warnings, set doctor.strict=false"
        )
    rank_zero_info("doctor:\n%s", text)  # every rank checks; one prints
    return findings


def resolve_target(cfg: LMConfig) -> Target:
    """The target `lm doctor` checks: this machine's GPU if it has one; else the catalog GPU named by `gpu=`
    (planning a GPU run from a laptop, `runtime.planning_gpu`); else this CPU."""
    rt = runtime.resolve(cfg, runtime.planning_gpu(cfg))
    run_dir = rundir.run_directory(cfg.run.root, cfg.run.name)
    return Target(cfg, rt.gpu, rt.cuda, rt.precision, run_dir, cost.load_catalog(conf_dir()))
