"""`lm ablate SPEC.yaml`: a baseline and its variants over several seeds at equal tokens, and whether each paid.

A spec names the runs (YAML; every key but `variants` optional):

    name: levers-tiny
    base: [model=tiny, trainer.max_steps=300, trainer.val_every_steps=30]   # any overrides, +experiment=...
    seeds: 3                     # or a list: [0, 1, 2]; `run.seed` = init and data order
    baseline: []                 # overrides of the baseline alone
    variants:
      qk_norm: [model.qk_norm=true]
      relu2: [model.mlp=relu2_gated]
    fractions:                   # shorter runs of a variant, each with its own LR decay
      relu2: [0.6, 0.8]
    gpu: h100_sxm                # the catalog entry the modelled dollars use
    mfu: 0.45

Every run is a real `python train.py` in `<out>/runs/<variant>-s<seed>` (a fraction: `<variant>-f0.8-s<seed>`),
so a killed ablation continues where it stopped: finished runs are kept, interrupted ones resume from their
checkpoint, and a variant added to the spec later reuses the baseline's runs. Jobs run seed by seed, so the
machine's load falls on every variant alike and a partial ablation is balanced.

Per variant, from what the runs left on disk (`ablation.md`, `.csv`, `.json`, `ablation.png`):
- final validation loss (the evaluation at the last step): mean and 95% t interval over seeds;
- the difference to the baseline, paired by seed, and the verdict: wins / loses (the interval excludes 0),
  within noise;
- tokens to reach the baseline's mean final loss, as a ratio with its interval. With `fractions` runs it is
  read off the variant's final losses at each length (every one decayed: a fair comparison); without, off the
  full run's validation curve, whose decay is still ahead mid-run: an upper bound, labelled so;
- FLOPs per token (the cost model's formula on the variant's shape, plus Muon's Newton-Schulz FLOPs per step
  over the tokens of a step) and measured seconds per step (every arm's
  steps interleaved in one process, `step_times.json`: the runs' own times, minutes apart on a shared machine,
  are kept in the runs table but not compared) as ratios to the baseline;
- modelled dollars to reach the baseline's final loss, as a ratio (tokens x FLOPs per token, seed by seed);
- dollars per loss point, modelled: FLOPs / (MFU x the catalog GPU's bf16 peak) at its price, over the drop
  from a uniform guess (ln V) to the final loss.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from lm.base.exits import EXIT_PREEMPTED, one_line
from lm.numbers.batch_ramp import BatchRamp
from lm.numbers.cost import ASSUMED_MFU
from lm.numbers.stats import Interval, difference, t_interval, verdict
from lm.store import rundir
from lm.store.atomic import write_atomic

log = logging.getLogger(__name__)

BASELINE = "baseline"
NAME = re.compile(r"^[A-Za-z0-9_.+]+$")
SPEC_KEYS = {"name", "base", "seeds", "baseline", "variants", "fractions", "gpu", "mfu", "pricing"}
STOP_GRACE_S = 120.0
"""How long runs get to save and exit after `lm ablate` itself is told to stop."""


@dataclass
class Spec:
    """What to compare: a base config, the variants' overrides, the seeds, the fractions of a run's length."""

    name: str
    variants: dict[str, list[str]]
    base: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    baseline: list[str] = field(default_factory=list)
    fractions: dict[str, list[float]] = field(default_factory=dict)
    gpu: str = "h100_sxm"
    mfu: float = ASSUMED_MFU
    pricing: str = "on_demand"

    @property
    def arms(self) -> dict[str, list[str]]:
        """The baseline and every variant, each with its own overrides."""
        return {BASELINE: self.baseline, **self.variants}


def overrides_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"{where} must be a list of overrides like [model.qk_norm=true]; got {value!r}")


def load_spec(path: Path) -> Spec:
    """The spec at `path`, checked: a clear error names the key and what it should be."""
    if not path.is_file():
        raise FileNotFoundError(f"no ablation spec at {path}; write one (see `lm ablate --help`)")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: an ablation spec is a mapping with at least `variants`")
    unknown = set(raw) - SPEC_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}; a spec has {sorted(SPEC_KEYS)}")
    variants = raw.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise ValueError(f"{path}: `variants` must map each variant's name to its overrides")
    spec = Spec(
        name=str(raw.get("name") or path.stem),
        variants={str(k): overrides_list(v, f"variants.{k}") for k, v in variants.items()},
        base=overrides_list(raw.get("base"), "base"),
        seeds=seed_list(raw.get("seeds", 3)),
        baseline=overrides_list(raw.get("baseline"), "baseline"),
        fractions={str(k): [float(f) for f in v] for k, v in (raw.get("fractions") or {}).items()},
        gpu=str(raw.get("gpu", "h100_sxm")),
        mfu=float(raw.get("mfu", ASSUMED_MFU)),
        pricing=str(raw.get("pricing", "on_demand")),
    )
    check_spec(spec, path)
    return spec


def seed_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return list(range(value))
    if (
        isinstance(value, list)
        and value
        and all(isinstance(s, int) for s in value)
        and len(set(value)) == len(value)
    ):
        return list(value)
    raise ValueError(f"seeds must be a count (3) or a list of distinct integers ([0, 1, 2]); got {value!r}")


def check_spec(spec: Spec, path: Path) -> None:
    for name in spec.arms:
        if not NAME.match(name):
            raise ValueError(f"{path}: variant name {name!r} may hold only letters, digits and _ . +")
    if BASELINE in spec.variants:
        raise ValueError(f"{path}: `{BASELINE}` is the baseline's name; set its overrides with `baseline:`")
    for name, fractions in spec.fractions.items():
        if name not in spec.arms:
            raise ValueError(f"{path}: fractions.{name} names no variant; variants: {sorted(spec.arms)}")
        if not all(0 < f < 1 for f in fractions):
            raise ValueError(f"{path}: fractions.{name} must lie strictly between 0 and 1; got {fractions}")
    if not 0 < spec.mfu <= 1:
        raise ValueError(f"{path}: mfu must be in (0, 1]; got {spec.mfu}")


# -- jobs -------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One training run of the ablation."""

    arm: str
    seed: int
    fraction: float
    steps: int
    overrides: list[str]
    run_dir: Path

    @property
    def name(self) -> str:
        part = f"-f{self.fraction:g}" if self.fraction < 1 else ""
        return f"{self.arm}{part}-s{self.seed}"


@dataclass(frozen=True)
class Shape:
    """What the composed config of one arm says about its runs (checked once, before any run starts)."""

    steps: int
    val_every: int
    tokens_per_step: int
    flops_per_token: float
    vocab_size: int
    ramp: BatchRamp | None = None
    """The arm's batch-size ramp (data.batch_ramp_steps): its first steps train fewer tokens."""

    def tokens_through(self, steps: int) -> int:
        """Tokens the arm's first `steps` optimizer steps train."""
        return self.ramp.tokens_through(steps) if self.ramp else steps * self.tokens_per_step


def arm_shape(overrides: list[str]) -> Shape:
    """Compose an arm's config (refusing a bad override before any run starts) and read its numbers."""
    from lm.config import compose, to_objects
    from lm.engine import optim
    from lm.numbers import cost, run_plan

    cfg = to_objects(compose(overrides))
    plan = run_plan.resolve(cfg.data, cfg.trainer, cfg.optim, world=1)
    steps, every = cfg.trainer.max_steps, cfg.trainer.val_every_steps
    if cfg.optim.total_steps not in (None, steps):
        raise ValueError(
            f"optim.total_steps={cfg.optim.total_steps} differs from trainer.max_steps={steps}: an ablation "
            "compares runs at the end of their LR decay; drop optim.total_steps from the base"
        )
    if steps % every:
        raise ValueError(
            f"trainer.max_steps={steps} is not a multiple of trainer.val_every_steps={every}: the final loss "
            "must be evaluated at the last step; pick values that divide"
        )
    # Muon's orthogonalisation is a cost per step: per token it is that over the tokens of a full step.
    optimizer = optim.muon_flops_per_step(cfg.model, cfg.optim) / plan.tokens_per_step
    flops = cost.flops_per_token(cfg.model, cfg.data.seq_len) + optimizer
    return Shape(steps, every, plan.tokens_per_step, flops, cfg.data.vocab_size, plan.ramp)


def fraction_steps(shape: Shape, fraction: float) -> int:
    """A shorter run's steps: `fraction` of the base rounded to whole validation intervals (at least one)."""
    return max(1, round(fraction * shape.steps / shape.val_every)) * shape.val_every


def plan_jobs(spec: Spec, out: Path, shapes: dict[str, Shape]) -> list[Job]:
    """Every run, seed by seed (so a partial ablation is balanced), the baseline first within a seed."""
    jobs = []
    for seed in spec.seeds:
        for arm, overrides in spec.arms.items():
            lengths = [(1.0, shapes[arm].steps)]
            lengths += [(f, fraction_steps(shapes[arm], f)) for f in spec.fractions.get(arm, [])]
            for fraction, steps in lengths:
                extra = (
                    [] if fraction == 1.0 else [f"trainer.max_steps={steps}", f"optim.total_steps={steps}"]
                )
                job = Job(arm, seed, fraction, steps, [], out / "runs")
                job.run_dir = out / "runs" / job.name
                job.overrides = [
                    *spec.base, *overrides, *extra, f"run.seed={seed}", f"run.root={out / 'runs'}",
                    f"run.name={job.name}",
                ]  # fmt: skip
                jobs.append(job)
    return jobs


def finished(job: Job) -> bool:
    """The run reached its last step (its cost ledger says so) or its early stopper ended it."""
    ledger = rundir.read_ledger(job.run_dir) or {}
    stop = rundir.read_record(job.run_dir / rundir.STOP) or {}
    return (ledger.get("step") or 0) >= job.steps or bool(stop.get("stopped"))


class Runner:
    """Runs jobs `parallel` at a time, each a `python train.py` with `threads` CPU threads and a time limit.

    SIGTERM or SIGINT to `lm ablate` is passed to the running jobs (each saves its checkpoint and exits 75),
    then the ablation exits 75 too: rerunning the same command continues."""

    def __init__(self, out: Path, parallel: int, threads: int | None, timeout: float) -> None:
        self.out, self.parallel, self.threads, self.timeout = out, parallel, threads, timeout
        self.stopping: list[int] = []
        self.running: dict[str, tuple[subprocess.Popen, float, Job, io.TextIOBase]] = {}
        self.failed: dict[str, str] = {}

    def command(self, job: Job) -> list[str]:
        from lm.config.loading import conf_dir

        return [sys.executable, str(conf_dir().parent / "train.py"), *job.overrides]

    def start(self, job: Job) -> None:
        env = dict(os.environ)
        if self.threads:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_file = open(logs / f"{job.name}.log", "a")  # noqa: SIM115 (closed when the job ends)
        log.info("lm ablate: start %s", job.name)
        child = subprocess.Popen(self.command(job), env=env, stdout=log_file, stderr=subprocess.STDOUT)
        self.running[job.name] = (child, time.monotonic(), job, log_file)

    def reap(self) -> list[Job]:
        """Jobs that ended since the last call (a job past its time limit is stopped and counted failed)."""
        ended = []
        for name, (child, started, job, log_file) in list(self.running.items()):
            code = child.poll()
            if code is None and time.monotonic() - started > self.timeout and not self.stopping:
                stop_child(child)
                code, self.failed[name] = child.returncode, f"over the {self.timeout:.0f} s limit"
            if code is None:
                continue
            log_file.close()
            del self.running[name]
            if code != 0 and name not in self.failed and not self.stopping:
                self.failed[name] = f"exit {code}; see {self.out / 'logs' / (name + '.log')}"
            ended.append(job)
        return ended

    def run(self, jobs: list[Job], on_end) -> None:
        def forward(signum: int, frame) -> None:
            self.stopping.append(signum)
            for child, *_ in self.running.values():
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            queue = list(jobs)
            while (queue and not self.stopping) or self.running:
                while queue and len(self.running) < self.parallel and not self.stopping:
                    self.start(queue.pop(0))
                for job in self.reap():
                    on_end(job)
                time.sleep(0.2)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def step_times(spec: Spec, steps: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median seconds of one training step (forward, backward, clip, optimizer) of every arm, measured in ONE
    process with the arms' steps interleaved in rotating order, so a shared machine's load falls on all alike
    (the runs' own times, taken minutes apart, differ by 2x on a loaded 2-core machine). Eager, on the CPU or
    the first GPU, the base's full batch of random tokens."""
    import statistics

    import torch

    from lm.config import compose, to_objects
    from lm.engine import optim as lm_optim
    from lm.engine.module import LMModule

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arms, modules, optimizers, batches = list(spec.arms), {}, {}, {}
    for arm in arms:
        cfg = to_objects(compose([*spec.base, *spec.arms[arm]]))
        torch.manual_seed(0)
        modules[arm] = LMModule(cfg.model, cfg.optim).to(device)
        optimizers[arm] = lm_optim.build(modules[arm].model, cfg.optim, fused=False)
        shape = (cfg.data.batch_size, cfg.data.seq_len + 1)
        batches[arm] = torch.randint(0, cfg.model.vocab_size, shape, device=device)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for i in range(steps + warmup):
        for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:
            started = time.perf_counter()
            loss = modules[arm].objective(batches[arm])[0]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(modules[arm].parameters(), 1.0)
            optimizers[arm].step()
            optimizers[arm].zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:  # first steps: the allocator, first touch of the optimizer's state
                times[arm].append(time.perf_counter() - started)
    return {arm: statistics.median(t) for arm, t in times.items()}


def cached_step_times(spec: Spec, out: Path, threads: int | None) -> dict[str, float]:
    """`step_times`, kept in `<out>/step_times.json`; measured again (all arms at once) when an arm is new."""
    path = out / "step_times.json"
    known = rundir.read_record(path) or {}
    if all(arm in known for arm in spec.arms):
        return known
    if threads:
        import torch

        torch.set_num_threads(threads)
    measured = step_times(spec)
    rundir.write_record(path, measured)
    return measured


def prepare_data(spec: Spec, timeout: float) -> None:
    """`lm prepare` of the base config: the tokenizer and shards every run reads (a no-op when present)."""
    from lm.config import compose, to_objects
    from lm.data import prepare

    cfg = to_objects(compose(spec.base))
    if not cfg.data.mixture:
        prepare(cfg.data)


def stop_child(child: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM (the run saves and exits 75), then SIGKILL after `grace` seconds."""
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


# -- reading the runs ---------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one run left on disk."""

    job: str
    arm: str
    seed: int
    fraction: float
    status: str
    steps: list[int] = field(default_factory=list)
    """Optimizer steps trained at each validation."""
    tokens: list[float] = field(default_factory=list)
    """Tokens trained at those steps."""
    val_loss: list[float] = field(default_factory=list)
    final: float | None = None
    """The validation loss at the run's last step (None until it is evaluated there)."""
    seconds_per_step: float | None = None


def read_run(job: Job, shape: Shape) -> RunResult:
    """A job's curve and final loss from its TensorBoard events, its speed from its cost ledger."""
    result = RunResult(job.name, job.arm, job.seed, job.fraction, "done" if finished(job) else "incomplete")
    if not job.run_dir.is_dir():
        result.status = "not started"
        return result
    series = rundir.read_scalars(job.run_dir).get("val/loss")
    if series is not None and len(series):
        # Lightning logs a validation after step k's update under step k-1 (the index of its last batch).
        result.steps = [int(s) + 1 for s in series.steps]
        result.tokens = [float(shape.tokens_through(s)) for s in result.steps]
        result.val_loss = [float(v) for v in series.values]
        if result.status == "done" and result.steps[-1] >= job.steps and math.isfinite(result.val_loss[-1]):
            result.final = result.val_loss[-1]
    ledger = rundir.read_ledger(job.run_dir) or {}
    train_s, step = (ledger.get("seconds") or {}).get("train"), ledger.get("step")
    if train_s and step:
        result.seconds_per_step = train_s / step
    return result


def tokens_to_reach(points: list[tuple[float, float]], target: float) -> tuple[float | None, bool]:
    """The first token count at which the loss reaches `target`, linear between points (tokens, loss).

    Returns (tokens, censored): censored when the first point is already below the target (the true count
    is at most that); (None, False) when no point reaches it."""
    points = sorted(points)
    if not points:
        return None, False
    if points[0][1] <= target:
        return points[0][0], True
    for (t0, l0), (t1, l1) in itertools.pairwise(points):
        if l1 <= target:
            return t0 + (l0 - target) / (l0 - l1) * (t1 - t0), False
    return None, False


# -- the summary -----------------------------------------------------------------------------------------


@dataclass
class ArmRow:
    """One variant against the baseline."""

    arm: str
    overrides: str
    seeds: int
    final: Interval | None
    delta: Interval | None
    paired: str
    verdict: str
    tokens_ratio: Interval | None
    tokens_method: str
    reached: str
    flops_ratio: float
    step_time_ratio: float | None
    usd: float | None
    usd_per_point: float | None
    usd_per_point_ratio: float | None
    usd_to_target_ratio: Interval | None = None
    """Modelled dollars to reach the baseline's mean final loss, over the baseline's: tokens x FLOPs ratios."""
    fractions: dict[str, Interval | None] = field(default_factory=dict)


def finals(results: list[RunResult], arm: str, fraction: float = 1.0) -> dict[int, float]:
    return {
        r.seed: r.final for r in results if r.arm == arm and r.fraction == fraction and r.final is not None
    }


def modelled_usd(tokens: float, flops_per_token: float, spec: Spec, gpu) -> float | None:
    """Dollars of `tokens` on the spec's GPU: FLOPs / (MFU x bf16 peak) seconds at its catalog price."""
    from lm.numbers import cost

    price = cost.catalog_price(gpu, spec.pricing)
    if not gpu.peak_bf16_tflops or price is None:
        return None
    seconds = tokens * flops_per_token / (spec.mfu * gpu.peak_bf16_tflops * 1e12)
    return cost.usd(seconds, price[0], 1)


def arm_tokens(results: list[RunResult], spec: Spec, arm: str, target: float) -> tuple[list[float], str, str]:
    """Per seed, the tokens at which `arm` reaches `target`, and how they were read."""
    seeds = sorted(finals(results, arm))
    use_fractions = bool(spec.fractions.get(arm))
    found, missing, censored = [], 0, 0
    for seed in seeds:
        runs = [r for r in results if r.arm == arm and r.seed == seed and r.final is not None]
        if use_fractions:
            points = [(r.tokens[-1], r.final) for r in runs]
        else:
            full = next(r for r in runs if r.fraction == 1.0)
            points = list(zip(full.tokens, full.val_loss))
        tokens, cut = tokens_to_reach(points, target)
        if tokens is None:
            missing += 1
        else:
            found.append(tokens)
            censored += cut
    method = (
        "final losses of shorter runs (each decayed)" if use_fractions else "full run's curve (upper bound)"
    )
    reached = f"{len(found)}/{len(seeds)}" + (f", {censored} at the shortest run or less" if censored else "")
    return found, method, reached


def summarize(
    spec: Spec, results: list[RunResult], shapes: dict[str, Shape], times: dict[str, float] | None = None
) -> list[ArmRow]:
    """One row per arm that has finished runs; the baseline's mean final loss is every row's reference."""
    from lm.config.loading import conf_dir
    from lm.numbers import cost

    gpu = cost.load_catalog(conf_dir()).get(spec.gpu)
    if gpu is None:
        raise ValueError(f"gpu: {spec.gpu!r} is not in the catalog (conf/gpu/); name one, e.g. h100_sxm")
    base = finals(results, BASELINE)
    target = t_interval(list(base.values()))
    base_shape = shapes[BASELINE]
    times = times or {}
    base_tokens = base_shape.tokens_through(base_shape.steps)
    base_usd = modelled_usd(base_tokens, base_shape.flops_per_token, spec, gpu)
    rows = []
    for arm, overrides in spec.arms.items():
        mine = finals(results, arm)
        if not mine:
            continue
        shape = shapes[arm]
        final = t_interval(list(mine.values()))
        delta, paired = difference(mine, base) if arm != BASELINE else (None, "-")
        tokens, method, reached = arm_tokens(results, spec, arm, target.mean) if target else ([], "-", "-")
        ratio = t_interval([t / base_tokens for t in tokens])
        usd = modelled_usd(shape.tokens_through(shape.steps), shape.flops_per_token, spec, gpu)
        per_point = usd / (math.log(shape.vocab_size) - final.mean) if usd is not None else None
        base_point = (
            base_usd / (math.log(base_shape.vocab_size) - target.mean) if base_usd and target else None
        )
        rows.append(
            ArmRow(
                arm=arm,
                overrides=" ".join(overrides) or "(base)",
                seeds=len(mine),
                final=final,
                delta=delta,
                paired=paired,
                verdict=verdict(delta) if arm != BASELINE else "-",
                tokens_ratio=ratio,
                tokens_method=method,
                reached=reached,
                flops_ratio=shape.flops_per_token / base_shape.flops_per_token,
                step_time_ratio=times[arm] / times[BASELINE] if arm in times and BASELINE in times else None,
                usd=usd,
                usd_per_point=per_point,
                usd_per_point_ratio=per_point / base_point if per_point and base_point else None,
                usd_to_target_ratio=t_interval(
                    [t / base_tokens * shape.flops_per_token / base_shape.flops_per_token for t in tokens]
                ),
                fractions={
                    f"{f:g}": t_interval(list(finals(results, arm, f).values()))
                    for f in spec.fractions.get(arm, [])
                },
            )
        )
    return rows


def fmt_interval(x: Interval | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if x.n == 1:
        return f"{x.mean:.{digits}f} (1 seed)"
    return f"{x.mean:.{digits}f} [{x.low:.{digits}f}, {x.high:.{digits}f}]"


def fmt_ratio(x: float | None) -> str:
    return f"{x:.3f}x" if x is not None else "-"


def markdown(spec: Spec, rows: list[ArmRow], results: list[RunResult], shapes: dict[str, Shape]) -> str:
    base = shapes[BASELINE]
    done = sum(r.status == "done" for r in results)
    lines = [
        f"# Ablation `{spec.name}`",
        "",
        f"Base: `{' '.join(spec.base) or '(defaults)'}`; seeds {spec.seeds}; {base.steps} steps x "
        f"{base.tokens_per_step:,} tokens ({base.tokens_through(base.steps):,} tokens a run); "
        f"{done}/{len(results)} runs done.",
        f"Intervals are 95% Student t over seeds; Δ is variant - baseline, paired by seed. Dollars are modelled: "
        f"FLOPs / (MFU {spec.mfu:g} x {spec.gpu}'s bf16 peak) at its {spec.pricing} price; a loss point is the "
        "drop from a uniform guess (ln V) to the final loss. Step times: medians of all arms' steps interleaved "
        "in one process on this machine (`step_times.json`).",
        "",
        "| variant | overrides | seeds | final val loss [95% CI] | Δ vs baseline [95% CI] | verdict | "
        "tokens to baseline's final, x [95% CI] | reached | FLOPs/token x (model + optimizer) | s/step x (measured) | "
        "modelled $ to baseline's final, x [95% CI] | modelled $ / loss point | x |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta = fmt_interval(r.delta) + (" (Welch)" if r.paired == "welch" else "")
        lines.append(
            f"| {r.arm} | `{r.overrides}` | {r.seeds} | {fmt_interval(r.final)} | {delta} | **{r.verdict}** | "
            f"{fmt_interval(r.tokens_ratio, 3)} | {r.reached} | {fmt_ratio(r.flops_ratio)} | "
            f"{fmt_ratio(r.step_time_ratio)} | {fmt_interval(r.usd_to_target_ratio, 3)} | "
            f"{'-' if r.usd_per_point is None else f'${r.usd_per_point:.3g}'} | {fmt_ratio(r.usd_per_point_ratio)} |"
        )
    methods = sorted({f"{r.arm}: {r.tokens_method}" for r in rows if r.arm != BASELINE})
    lines += ["", "Tokens to the baseline's final loss were read off: " + "; ".join(methods) + "."]
    shorter = [r for r in rows if r.fractions]
    if shorter:
        lines += ["", "## Shorter runs (each with its own warm-up and decay)", "",
                  "| variant | fraction of the steps | final val loss [95% CI] |", "|---|---|---|"]  # fmt: skip
        for r in shorter:
            for fraction, interval in r.fractions.items():
                lines.append(f"| {r.arm} | {fraction} | {fmt_interval(interval)} |")
    lines += ["", "## Runs", "", "| run | status | final val loss | s/step |", "|---|---|---|---|"]
    for r in results:
        final = "-" if r.final is None else f"{r.final:.4f}"
        speed = "-" if r.seconds_per_step is None else f"{r.seconds_per_step:.3f}"
        lines.append(f"| {r.job} | {r.status} | {final} | {speed} |")
    return "\n".join(lines) + "\n"


def csv_text(rows: list[ArmRow]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow([
        "variant", "overrides", "seeds", "final_mean", "final_low", "final_high", "delta_mean", "delta_low",
        "delta_high", "verdict", "tokens_ratio_mean", "tokens_ratio_low", "tokens_ratio_high", "reached",
        "flops_ratio", "step_time_ratio", "modelled_usd", "modelled_usd_per_loss_point", "usd_per_point_ratio",
        "usd_to_target_ratio_mean", "usd_to_target_ratio_low", "usd_to_target_ratio_high",
    ])  # fmt: skip
    for r in rows:
        writer.writerow([
            r.arm, r.overrides, r.seeds, *triple(r.final), *triple(r.delta), r.verdict, *triple(r.tokens_ratio),
            r.reached, r.flops_ratio, r.step_time_ratio, r.usd, r.usd_per_point, r.usd_per_point_ratio,
            *triple(r.usd_to_target_ratio),
        ])  # fmt: skip
    return buf.getvalue()


def triple(x: Interval | None) -> tuple[Any, Any, Any]:
    return (x.mean, x.low, x.high) if x is not None else (None, None, None)


def plot(path: Path, spec: Spec, results: list[RunResult]) -> None:
    """Validation loss against tokens: each arm's mean over seeds, the band from its lowest to highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    lows = []
    for arm in spec.arms:
        runs = [r for r in results if r.arm == arm and r.fraction == 1.0 and r.final is not None]
        if not runs:
            continue
        n = min(len(r.val_loss) for r in runs)
        losses = np.array([r.val_loss[:n] for r in runs])
        tokens = np.array(runs[0].tokens[:n])
        mean = losses.mean(axis=0)
        (line,) = ax.plot(tokens, mean, label=f"{arm} ({len(runs)} seeds)")
        ax.fill_between(tokens, losses.min(axis=0), losses.max(axis=0), color=line.get_color(), alpha=0.2)
        lows.append((mean[-1], mean[max(0, n // 5)]))
    if lows:  # the end of the runs, where arms differ, not the first steps' drop from ln V
        ax.set_ylim(min(lo for lo, _ in lows) - 0.05, max(hi for _, hi in lows))
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{spec.name}: mean over seeds, band = min..max")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def write_summary(
    spec: Spec, out: Path, jobs: list[Job], shapes: dict[str, Shape], times: dict[str, float] | None = None
) -> tuple[Path, list[ArmRow]]:
    """Read every run back from disk and (re)write ablation.md / .csv / .json / .png."""
    results = [read_run(job, shapes[job.arm]) for job in jobs]
    rows = summarize(spec, results, shapes, times) if finals(results, BASELINE) else []
    md = out / "ablation.md"
    write_atomic(md, markdown(spec, rows, results, shapes))
    write_atomic(out / "ablation.csv", csv_text(rows))
    record = {"spec": asdict(spec), "rows": [asdict(r) for r in rows], "runs": [asdict(r) for r in results]}
    write_atomic(out / "ablation.json", json.dumps(record, indent=1, default=str))
    if rows:
        plot(out / "ablation.png", spec, results)
    return md, rows


def ablate(
    spec_path: Path,
    out: Path | None = None,
    parallel: int = 1,
    threads: int | None = None,
    timeout: float = 3600.0,
    report_only: bool = False,
) -> int:
    """Run (or continue) the ablation and write its summary; the exit status to leave with."""
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # its event reader logs every file it opens
    spec = load_spec(spec_path)
    out = out or Path("runs") / "ablate" / spec.name
    shapes = {}
    for arm, overrides in spec.arms.items():
        try:
            shapes[arm] = arm_shape([*spec.base, *overrides])
        except Exception as e:  # Hydra's and OmegaConf's errors too: a bad override is refused before any run
            raise ValueError(f"{spec_path}: {arm}'s config is refused: {one_line(e)}") from e
    jobs = plan_jobs(spec, out, shapes)
    todo = [] if report_only else [job for job in jobs if not finished(job)]
    log.info("lm ablate: %d runs, %d to run (%d done)", len(jobs), len(todo), len(jobs) - len(todo))
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, parallel, threads, timeout)
    if todo:
        prepare_data(spec, timeout)  # once, before parallel runs would each tokenize the same corpus
        runner.run(todo, lambda job: write_summary(spec, out, jobs, shapes))
    times = cached_step_times(spec, out, threads) if not runner.stopping else None
    md, _ = write_summary(spec, out, jobs, shapes, times)
    print(md.read_text(), end="")
    print(f"wrote {md}, ablation.csv, ablation.json and ablation.png in {out}")
    if runner.stopping:
        print(f"lm ablate: stopped by a signal; rerun the same command to continue ({out})", file=sys.stderr)
        return EXIT_PREEMPTED
    if runner.failed:
        for name, why in runner.failed.items():
            print(f"lm ablate: run {name} failed: {why}", file=sys.stderr)
        return 1
    return 0
