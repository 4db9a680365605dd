"""The preflight doctor: forgotten free optimizations and plan problems, found before a cent is spent.

Each component states its own checks beside its code, as a function of its own config sections that returns
findings (`lm.base.findings.Finding`: a level (ok / warn / error), what it saw, the expected gain of fixing
it and the fix as a Hydra override). The doctor keeps the registry (`CHECKS`: one line per check, handing
each its sections of the `Target`), runs them and draws the table. `lm doctor` prints it; `lm.run.train.main`
runs them first and refuses the run on an error (or on a warning with `doctor.strict=true`).

Gains quote the seed articles where they measured one (experiments and docs name which); elsewhere they are
stated estimates. GPU-only advice (compile, TF32, bf16, workers) stays silent on a CPU run: a CPU smoke test
is not worth nagging about.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

from lm.base.exits import Refused
from lm.base.findings import LEVELS, Finding
from lm.callbacks.run_tokenizer import tokenizer_findings
from lm.checkpoint.checkpointer import resume_candidates
from lm.checkpoint.local import disk_findings, format_findings, host_memory_bytes
from lm.config import DataConfig, GpuConfig, LMConfig, conf_dir
from lm.data.datamodule import pickle_findings, worker_findings
from lm.data.manifest import prepared_folder, train_tokens
from lm.data.mixture import mixture_findings
from lm.engine import activation_checkpointing as ac
from lm.engine import runtime
from lm.engine.fp8 import fp8_findings
from lm.engine.kernels import vocab_findings
from lm.engine.optim import optimizer_findings
from lm.numbers import cost, memory, run_plan
from lm.store import rundir
from lm.store.bench_file import measured_mfu

__all__ = ["CHECKS", "LEVELS", "Finding", "Target", "diagnose", "preflight", "resolve_target", "table"]


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
    plan: run_plan.RunPlan | None = None
    """The run's plan, as `lm.run.train` resolved it (resolved here from the config when not given)."""

    def __post_init__(self) -> None:
        if self.plan is None:
            c = self.cfg
            self.plan = run_plan.resolve(c.data, c.trainer, c.optim, c.phases.phases)

    @functools.cached_property
    def n_params(self) -> int:
        """The model's parameter count (counted once on the meta device; three checks read it)."""
        return memory.parameter_count(self.cfg.model)[0]

    @property
    def workload(self) -> memory.Workload:
        """One process's training step, as the memory model sees it."""
        c = self.cfg
        return memory.Workload(
            c.model,
            batch_size=c.data.batch_size,
            seq_len=c.data.seq_len,
            precision=self.precision,
            cuda=self.cuda,
            every=c.activation_checkpointing.every,
            headroom=c.doctor.headroom,
            shards=self.world if c.trainer.strategy == "fsdp" else 1,
        )

    @property
    def world(self) -> int:
        """Processes of the job (trainer.devices x trainer.num_nodes)."""
        return run_plan.world_size(self.cfg.trainer, cuda=self.cuda)


# -- the registry: each check hands a component its own sections ------------------------------------------


def check_memory(t: Target) -> list[Finding]:
    c = t.cfg
    return ac.memory_findings(
        t.workload, c.activation_checkpointing.auto, c.trainer.accumulate_grad_batches, t.gpu
    )


def check_precision(t: Target) -> list[Finding]:
    p = t.cfg.precision
    return runtime.precision_findings(t.cuda, t.precision, t.gpu, p.tf32) + fp8_findings(
        p.fp8, p.fp8_emulate, t.cuda
    )


def check_kernels(t: Target) -> list[Finding]:
    return runtime.compile_findings(t.cuda, t.cfg.kernels)


def check_workers(t: Target) -> list[Finding]:
    return worker_findings(t.cfg.data, t.cuda)


def check_vocab(t: Target) -> list[Finding]:
    return vocab_findings(t.cfg.model)


def check_disk(t: Target) -> list[Finding]:
    return disk_findings(t.run_dir, t.n_params, t.cfg.checkpoint.keep_last)


def check_checkpoint_format(t: Target) -> list[Finding]:
    c = t.cfg
    return format_findings(
        t.n_params,
        t.world,
        c.trainer.strategy,
        c.checkpoint.format,
        c.checkpoint.async_save,
        host_memory_bytes(),
    )


def check_pickles(t: Target, dataset=None) -> list[Finding]:
    return pickle_findings(t.cfg.data, dataset)


def check_plan(t: Target) -> list[Finding]:
    return run_plan.plan_findings(t.plan, t.n_params, t.cuda, corpus_tokens(t.cfg.data))


def corpus_tokens(data: DataConfig) -> int | None:
    """Training tokens of the prepared corpus (its manifest), None before it is prepared or for a mixture (whose
    sources repeat at their own rates); a damaged manifest is the data checks' to refuse, not this line's."""
    if data.mixture:
        return None
    folder = prepared_folder(data)
    try:
        return train_tokens(folder) if folder is not None else None
    except (OSError, ValueError, KeyError, Refused):
        return None


def check_price(t: Target) -> list[Finding]:
    c = t.cfg
    ratio = cost.fp8_peak_ratio(t.gpu)
    bench_mfu = (
        measured_mfu(Path(c.bench.out_dir), t.gpu.name, c.model, t.n_params, ratio) if t.cuda else None
    )
    return cost.price_findings(
        t.workload, t.gpu, t.catalog, c.cost, c.precision.tf32, c.doctor.assumed_mfu, bench_mfu
    )


def check_evals(t: Target) -> list[Finding]:
    if not t.cfg.evals.tasks:
        return []
    from lm.evals.findings import evals_findings  # an optional feature: loaded when configured

    return evals_findings(t.cfg.evals)


def check_init_from(t: Target) -> list[Finding]:
    """`model.init_from` of a fresh run: here, so that a refusal leaves no run directory, lock or hydra/<time>/.
    A run that resumes reads its checkpoint, not init_from; one that may resume a remote checkpoint is
    checked once it knows (`lm.run.train.open_run`)."""
    c = t.cfg
    resumes = c.run.resume and (
        c.checkpoint.remote is not None or bool(resume_candidates(t.run_dir / rundir.CHECKPOINTS))
    )
    if resumes or c.model.init_from is None:
        return []
    from lm.interop.hf import init_from_findings  # an optional feature: loaded when configured

    return init_from_findings(c.model, c.data.seq_len)


def check_optimizer(t: Target) -> list[Finding]:
    return optimizer_findings(t.cfg.model, t.cfg.optim)


def check_forecast(t: Target) -> list[Finding]:
    s = t.cfg.early_stopping
    if s.forecast_model != "reference" and not s.use_forecast:
        return []  # no forecast decides anything
    from lm.numbers import reference  # an optional feature: loaded when configured

    return reference.cadence_findings(s, t.plan.end_steps, t.cfg.trainer.val_every_steps)


def check_tokenizer(t: Target) -> list[Finding]:
    return tokenizer_findings(t.run_dir, t.cfg.data, t.cfg.run.resume)


def check_mixture(t: Target) -> list[Finding]:
    return mixture_findings(t.cfg.data, t.cfg.phases.phases, t.plan)


CHECKS: list[Callable[[Target], list[Finding]]] = [
    check_memory,
    check_precision,
    check_kernels,
    check_workers,
    check_vocab,
    check_disk,
    check_checkpoint_format,
    check_pickles,
    check_plan,
    check_mixture,
    check_price,
    check_evals,
    check_init_from,
    check_optimizer,
    check_forecast,
    check_tokenizer,
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
    """Diagnose, log the table, and refuse (`Refused`, exit 78) on any error (any warning when strict): the
    table printed as a table, errors first, the fix commands last."""
    strict = t.cfg.doctor.strict if strict is None else strict
    findings = diagnose(t)
    errors = [f for f in findings if level_of(f, strict) == "error"]
    if errors:
        worst_first = sorted(findings, key=lambda f: -LEVELS.index(level_of(f, strict)))
        text = table(worst_first, strict)
        raise Refused(
            f"the doctor refuses this run ({len(errors)} error(s)"
            + (", doctor.strict=true" if strict else "")
            + f"):\n{text}\nfix them (the overrides above) or, for warnings, set doctor.strict=false",
            table=True,
        )
    rank_zero_info("doctor:\n%s", table(findings, strict))  # every rank checks; one prints
    return findings


def resolve_target(cfg: LMConfig) -> Target:
    """The target `lm doctor` checks: this machine's GPU if it has one; else the catalog GPU named by `gpu=`
    (planning a GPU run from a laptop, `runtime.planning_gpu`); else this CPU."""
    rt = runtime.resolve_runtime(cfg, runtime.planning_gpu(cfg.trainer, cfg.gpu))
    run_dir = rundir.run_directory(cfg.run.root, cfg.run.name)
    return Target(cfg, rt.gpu, rt.cuda, rt.precision, run_dir, cost.load_catalog(conf_dir()))
