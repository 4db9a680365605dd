"""`lm plan`: what a budget (dollars, a target loss or hours) buys on a corpus, ranked, and the chosen plan
written as an experiment file that `python train.py +experiment=<name>` runs.

For every model preset and catalogued GPU: throughput (peak x MFU / FLOPs per token, at `lm bench`'s measured
MFU or an assumed one, labelled so), the micro-batch and activation checkpointing that fit
(`lm.numbers.memory`), steps, hours, dollars on demand and on spot (spot pays the work lost per interruption),
storage, epochs, and the expected loss from L(N, D) = E + A/N^alpha + B/D^beta (`lm.numbers.loss_law`). Its
constants are published fits on another corpus, so the loss is labelled "uncalibrated" unless `--calibrate`
fitted it here; the ranking still orders shapes and token counts as compute-optimal scaling does."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from omegaconf import OmegaConf

from lm.base.exits import Refused
from lm.base.tables import fmt_money
from lm.checkpoint.local import estimate_checkpoint_bytes
from lm.config import DataConfig, GpuConfig
from lm.model import ModelConfig
from lm.numbers import cost, memory
from lm.numbers.batch_ramp import BatchRamp
from lm.numbers.core_map import CoreMap, Forecast, loss_sd
from lm.numbers.cost import ASSUMED_MFU
from lm.numbers.loss_law import (
    BESIROGLU,
    HOFFMANN,
    REPEAT_SCALE,
    USEFUL_EPOCHS,
    WORTHWHILE_EPOCHS,
    ChinchillaLaw,
)
from lm.store.bench_file import measured_mfu
from lm.tools.corpus_size import CorpusSize

RESTART_HOURS = 0.1
"""Time a spot interruption costs besides the lost work: a new machine, the image, reloading the checkpoint."""
DECAY_FRACTION = 0.2
"""The written plan's wsd schedule decays over its last 20%, as the seed's 1B plan did."""
CHECKPOINT_HOURS = 0.5
"""Checkpoint interval the plan aims for (Young/Daly for roughly one hard failure a day; experiments/2026-11-22-spot)."""


@dataclass(frozen=True)
class Goal:
    """Exactly one of: spend this many dollars, reach this loss, reach this CORE, train this many hours."""

    usd: float | None = None
    target_loss: float | None = None
    hours: float | None = None
    pricing: str = "on_demand"
    """Which price a dollar budget is spent at: `on_demand` or `spot` (with its interruption overhead)."""
    target_core: float | None = None
    """A CORE to reach with probability `confidence` at least, through the loss-to-CORE map."""
    confidence: float = 0.9

    @property
    def is_target(self) -> bool:
        """A target (the cheapest plan reaching it) rather than a budget (the best plan it buys)."""
        return self.target_loss is not None or self.target_core is not None


@dataclass(frozen=True)
class Hardware:
    """One GPU of the catalog as the plan prices it."""

    gpu: GpuConfig
    tokens_per_sec: float
    throughput_source: str
    """`measured by lm bench (MFU x)`, `assumed MFU x` or `given`."""
    price_on_demand: float | None
    price_spot: float | None


@dataclass
class BudgetPlan:
    """One ranked option."""

    preset: str
    model: ModelConfig
    params: int
    hw: Hardware
    tokens_per_step: int
    micro_batch: int
    accumulate: int
    ac_every: int
    steps: int
    hours: float
    usd_on_demand: float | None
    usd_spot: float | None
    spot_overhead: float
    """Expected extra wall clock on spot, as a fraction of the run."""
    checkpoint_every: int
    storage_gb: float
    epochs: float
    loss: float
    """Expected final loss, the corpus's repetition counted (Muennighoff et al. 2023's data-constrained law)."""
    loss_low: float
    loss_high: float
    law: str
    repeat_cost: float = 0.0
    """What the corpus's size costs: `loss` minus the loss had every token been fresh (the data-constrained
    law's repeated tokens and parameters past what the unique tokens support)."""
    ramp: BatchRamp | None = None
    """The batch-size ramp the steps train with (`data.batch_ramp_steps`); None: the full batch throughout."""
    core: Forecast | None = None
    """The CORE the plan's loss buys, through the loss-to-CORE map, its loss interval counted."""
    p_target: float | None = None
    """P(CORE >= the goal's target_core), for a CORE target."""

    @property
    def tokens(self) -> int:
        return self.ramp.tokens_through(self.steps) if self.ramp else self.steps * self.tokens_per_step


def load_presets(conf: Path, data: DataConfig) -> dict[str, ModelConfig]:
    """The model presets of conf/model/, at the data config's vocabulary and sequence length."""
    presets = {}
    for path in sorted((conf / "model").glob("*.yaml")):
        raw = OmegaConf.load(path)
        raw.vocab_size, raw.max_seq_len = data.vocab_size, data.seq_len
        presets[path.stem] = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))
    return presets


def hardware(
    gpu: GpuConfig,
    model: ModelConfig,
    flops_per_token: float,
    bench_dir: Path | None,
    *,
    tokens_per_sec: float | None = None,
    price_per_hour: float | None = None,
) -> Hardware | None:
    """Throughput and prices of `model` on `gpu`; None when the catalog cannot price or time it."""
    on_demand = price_per_hour if price_per_hour is not None else gpu.price_on_demand
    spot = price_per_hour if price_per_hour is not None else gpu.price_spot
    if on_demand is None and spot is None:
        return None
    if tokens_per_sec is not None:
        return Hardware(gpu, tokens_per_sec, "given", on_demand, spot)
    if not gpu.peak_bf16_tflops:
        return None
    n_params = memory.parameter_count(model)[0]
    ratio = cost.fp8_peak_ratio(gpu)
    mfu = measured_mfu(bench_dir, gpu.name, model, n_params, ratio) if bench_dir else None
    source = f"measured by lm bench (MFU {mfu:.2f})" if mfu else f"assumed MFU {ASSUMED_MFU:.2f}"
    rate = gpu.peak_bf16_tflops * 1e12 * (mfu or ASSUMED_MFU) / flops_per_token
    return Hardware(gpu, rate, source, on_demand, spot)


def fit_micro_batch(model: ModelConfig, gpu: GpuConfig, seq_len: int, windows: int) -> tuple[int, int] | None:
    """(micro-batch, activation checkpointing stride) that fit the GPU: the largest power-of-two micro-batch
    dividing the step's windows, without checkpointing if possible, else checkpointing every block. A device
    without catalogued memory (the CPU) takes the whole step in one micro-batch. None when nothing fits."""
    if not gpu.memory_gb:
        return windows, 0
    for ac_every in (0, 1):
        micro = 1 << int(math.log2(windows))
        while micro >= 1:
            if windows % micro == 0:
                est = memory.estimate(
                    model, batch_size=micro, seq_len=seq_len, precision="bf16-mixed", ac_every=ac_every
                )
                if memory.fits(est, gpu.memory_gb * 1e9):
                    return micro, ac_every
            micro //= 2
    return None


def spot_overhead(step_seconds: float, checkpoint_every: int, interruptions_per_hour: float) -> float:
    """Expected extra wall clock on spot per hour of training: each interruption loses half a checkpoint
    interval of work on average, plus a restart."""
    interval_hours = step_seconds * checkpoint_every / 3600.0
    return interruptions_per_hour * (interval_hours / 2.0 + RESTART_HOURS)


def run_cost(tokens: int, tokens_per_sec: float, price: float | None) -> tuple[float, float | None]:
    """(hours, dollars) of training `tokens`: tokens / (tokens/s), priced as the cost meter does."""
    seconds = tokens / tokens_per_sec
    return seconds / 3600.0, (cost.usd(seconds, price, 1) if price is not None else None)


def steps_for(
    goal: Goal,
    hw: Hardware,
    step_seconds: float,
    overhead: float,
    n: int,
    tokens_per_step: int,
    law: ChinchillaLaw = BESIROGLU,
    corpus: int | None = None,
    interval: float | None = None,
    core: CoreMap | None = None,
) -> int:
    """Optimizer steps the goal asks for on this hardware (0 when it buys none); a target loss is reached on
    the corpus's `corpus` tokens repeated as needed (`ChinchillaLaw.tokens_for`)."""
    # A budget buys tokens only while they lower the loss: no further than WORTHWHILE_EPOCHS of the corpus.
    worthwhile = math.ceil(WORTHWHILE_EPOCHS * corpus / tokens_per_step) if corpus else math.inf
    if goal.hours is not None:
        return min(int(goal.hours * 3600.0 / step_seconds), worthwhile)
    if goal.usd is not None:
        price = hw.price_spot if goal.pricing == "spot" else hw.price_on_demand
        if price is None:
            return 0
        slow = 1.0 + overhead if goal.pricing == "spot" else 1.0
        return min(int(goal.usd / (step_seconds * slow * price / 3600.0)), worthwhile)
    if goal.target_core is not None:
        tokens = tokens_for_core(goal, n, law, interval, corpus, core)
    else:
        tokens = law.tokens_for(n, goal.target_loss, corpus)
    return math.ceil(tokens / tokens_per_step) if math.isfinite(tokens) else 0


def loss_interval(n: int, d: float, law: ChinchillaLaw, interval: float | None, corpus: int | None) -> tuple:
    """(loss, low, high) of `n` parameters trained on `d` tokens: +-`interval` around `law` (a calibrated
    law's fit error) or, when None, the span of the two published fits."""
    loss = law.loss(n, d, corpus)  # repeated tokens are worth less (Muennighoff et al. 2023)
    ends = [loss - interval, loss + interval] if interval is not None else [loss, HOFFMANN.loss(n, d, corpus)]
    return loss, min(ends), max(ends)


def tokens_for_core(
    goal: Goal, n: int, law: ChinchillaLaw, interval: float | None, corpus: int | None, core: CoreMap
) -> float:
    """The fewest tokens at which `n` parameters reach P(CORE >= goal.target_core) >= goal.confidence, the
    loss's interval and the map's counted (bisection in log tokens, 1e6-1e15); inf when none does."""

    def reaches(log_d: float) -> bool:
        loss, low, high = loss_interval(n, math.exp(log_d), law, interval, corpus)
        return core.probability_at_least(goal.target_core, loss, loss_sd(low, high)) >= goal.confidence

    lo, hi = math.log(1e6), math.log(1e15)
    if not reaches(hi):
        return math.inf
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return math.exp(hi)


def ramped_steps(goal: Goal, steps: int, ramp: BatchRamp) -> int:
    """The steps that train the tokens of `steps` full-batch steps with the batch-size ramp (its first steps
    train fewer): for a budget the most whose tokens it pays for, for a target loss the fewest reaching them.
    Without a ramp, `steps`."""
    tokens = steps * ramp.tokens_per_step
    n = ramp.steps_for_tokens(tokens)
    return n - 1 if not goal.is_target and ramp.tokens_through(n) > tokens else n


def make_plans(
    goal: Goal,
    presets: dict[str, ModelConfig],
    gpus: list[GpuConfig],
    *,
    seq_len: int,
    tokens_per_step: int,
    corpus: int,
    interruptions_per_hour: float = 0.1,
    bench_dir: Path | None = None,
    tokens_per_sec: float | None = None,
    price_per_hour: float | None = None,
    law: ChinchillaLaw = BESIROGLU,
    interval: float | None = None,
    ramp_steps: int = 0,
    ramp_start: float = 0.25,
    core: CoreMap | None = None,
) -> list[BudgetPlan]:
    """Every (preset, GPU) the goal can be met with, best first: lowest expected loss for a dollar or hour
    budget, cheapest for a target loss. The loss is `law`'s; its interval is +-`interval` (a calibrated law's
    fit error) or, when None, the span of the two published fits. `ramp_steps`/`ramp_start`: the batch-size
    ramp (data.batch_ramp_*), whose steps are counted by their tokens. `core`: the loss-to-CORE map each plan's
    CORE is read off (needed for a CORE target)."""
    windows = max(1, tokens_per_step // seq_len)
    plans = []
    for preset, model in presets.items():
        n = memory.parameter_count(model)[0]
        flops = cost.flops_per_token(model, seq_len)  # builds the model on the meta device: once per preset
        for gpu in gpus:
            hw = hardware(
                gpu, model, flops, bench_dir, tokens_per_sec=tokens_per_sec, price_per_hour=price_per_hour
            )
            if hw is None:
                continue
            plan = cost_candidate(
                goal, preset, model, hw, n=n, seq_len=seq_len, windows=windows, corpus=corpus,
                interruptions_per_hour=interruptions_per_hour, law=law, interval=interval,
                ramp_steps=ramp_steps, ramp_start=ramp_start, core=core,
            )  # fmt: skip
            if plan is not None:
                plans.append(plan)
    usd = lambda p: p.usd_on_demand if p.usd_on_demand is not None else math.inf  # noqa: E731
    if goal.is_target:
        return sorted(plans, key=usd)
    # Losses within 0.01 tie (a repeated corpus puts every large model at one loss): the cheaper plan first.
    return sorted(plans, key=lambda p: (round(p.loss, 2), usd(p)))


def cost_candidate(
    goal: Goal,
    preset: str,
    model: ModelConfig,
    hw: Hardware,
    *,
    n: int,
    seq_len: int,
    windows: int,
    corpus: int,
    interruptions_per_hour: float,
    law: ChinchillaLaw,
    interval: float | None,
    ramp_steps: int,
    ramp_start: float,
    core: CoreMap | None = None,
) -> BudgetPlan | None:
    """One (preset, GPU) of `make_plans`'s search, costed: the steps the goal needs, the micro-batch and
    activation checkpointing that fit, hours, dollars (spot with its restart overhead) and the expected loss;
    None when no micro-batch fits or the goal buys no step. `n`: the model's parameters."""
    step_seconds = windows * seq_len / hw.tokens_per_sec
    every = max(1, int(CHECKPOINT_HOURS * 3600 / step_seconds))
    overhead = spot_overhead(step_seconds, every, interruptions_per_hour)
    steps = steps_for(goal, hw, step_seconds, overhead, n, windows * seq_len, law, corpus, interval, core)
    fit = fit_micro_batch(model, hw.gpu, seq_len, windows) if steps >= 1 else None  # the slow part
    if fit is None:
        return None
    ramp = BatchRamp(fit[0], seq_len, windows // fit[0], 1, ramp_steps, ramp_start)
    steps = ramped_steps(goal, steps, ramp)
    d = ramp.tokens_through(steps)
    hours, usd_on_demand = run_cost(d, hw.tokens_per_sec, hw.price_on_demand)
    _, usd_spot = run_cost(d, hw.tokens_per_sec, hw.price_spot)
    loss, low, high = loss_interval(n, d, law, interval, corpus)
    sd = loss_sd(low, high)
    return BudgetPlan(
        preset=preset,
        model=model,
        params=n,
        hw=hw,
        tokens_per_step=windows * seq_len,
        micro_batch=fit[0],
        accumulate=windows // fit[0],
        ac_every=fit[1],
        steps=steps,
        hours=hours,
        usd_on_demand=usd_on_demand,
        usd_spot=usd_spot * (1.0 + overhead) if usd_spot is not None else None,
        spot_overhead=overhead,
        checkpoint_every=min(every, steps),
        storage_gb=estimate_checkpoint_bytes(n) * 4 / 1e9,  # keep_last 3 + last.ckpt's target
        epochs=d / corpus,
        loss=loss,
        repeat_cost=loss - law.loss(n, d),
        loss_low=low,
        loss_high=high,
        law=law.source,
        ramp=ramp if ramp_steps else None,
        core=core.predict(loss, sd) if core is not None else None,
        p_target=(
            core.probability_at_least(goal.target_core, loss, sd)
            if core and goal.target_core is not None
            else None
        ),
    )


def check_goal(
    goal: Goal,
    plans: list[BudgetPlan],
    gpus: list[GpuConfig],
    law: ChinchillaLaw = BESIROGLU,
    core: CoreMap | None = None,
    even_odds: list[BudgetPlan] | None = None,
) -> None:
    """A clear error when the goal buys nothing on any GPU. `even_odds`: for a CORE target, the plans that
    reach it at even odds, so the refusal says what the map can promise instead."""
    if plans:
        return
    names = ", ".join(g.name for g in gpus)
    if goal.usd is not None:
        raise Refused(
            f"--usd {goal.usd:g} is below the price of one optimizer step of every preset on {names}; "
            "raise the budget, or lower the tokens per step (--tokens-per-step)"
        )
    if goal.hours is not None:
        raise Refused(f"--hours {goal.hours:g} is shorter than one optimizer step of every preset on {names}")
    if goal.target_core is not None:
        cheapest = min(even_odds or [], key=lambda p: p.usd_on_demand or math.inf, default=None)
        raise Refused(
            f"no preset reaches P(CORE >= {goal.target_core:g}) >= {goal.confidence:g} on {names} within 1e15 "
            f"tokens by the {core.label() if core else 'CORE map'}"
            + (
                f"; at even odds (--confidence 0.5) the cheapest is {cheapest.preset} on {cheapest.hw.gpu.name}, "
                f"{cheapest.tokens / 1e9:.1f}B tokens, {fmt_money(cheapest.usd_on_demand)} on demand"
                if cheapest
                else ""
            )
            + (
                "; its interval is wide until calibrated: calibrate it on your own runs (`lm core-map`, "
                "docs/planning.md#core) or lower --confidence"
                if core is not None and not core.calibrated
                else "; lower the target or --confidence"
            )
        )
    raise Refused(
        f"--target-loss {goal.target_loss:g} is below what any preset reaches by the law "
        f"({law.source}: at least E = {law.E:.4g}); raise the target"
    )


def pick_gpus(catalog: dict[str, GpuConfig], names: list[str] | None) -> list[GpuConfig]:
    """The catalog entries asked for (all but the CPU by default); unknown names are refused."""
    if not names:
        return [g for name, g in catalog.items() if name != "cpu"]
    unknown = [n for n in names if n not in catalog]
    if unknown:
        raise Refused(f"unknown GPU {', '.join(unknown)}: use one of {', '.join(catalog)} (conf/gpu/)")
    return [catalog[n] for n in names]


def render(
    plans: list[BudgetPlan], top: int = 10, corpus: CorpusSize | None = None, core: CoreMap | None = None
) -> str:
    """The ranking as a text table; epochs of an estimated corpus read `~0.53` and the table says so."""
    approx = "~" if corpus is not None and corpus.estimated else ""
    head = (
        f"{'#':>2} {'model':<6} {'params':>8} {'gpu':<12} {'tok/s':>9} {'micro x acc':>11} {'AC':>3} "
        f"{'steps':>8} {'tokens':>9} {'epochs':>6} {'hours':>7} {'on demand':>10} {'spot':>10} "
        f"{'loss (interval)':>20} {'repeats':>8}  throughput"
    )
    with_core = any(p.core is not None for p in plans[:top])
    if with_core:
        head = head.replace("  throughput", f" {core_header(plans):>24}  throughput")
    lines = [head]
    for i, p in enumerate(plans[:top], 1):
        lines.append(
            f"{i:>2} {p.preset:<6} {p.params / 1e6:>7.1f}M {p.hw.gpu.name:<12} {p.hw.tokens_per_sec:>9,.0f} "
            f"{f'{p.micro_batch}x{p.accumulate}':>11} {'on' if p.ac_every else 'off':>3} {p.steps:>8,} "
            f"{p.tokens / 1e9:>8.3f}B {f'{approx}{p.epochs:.2f}':>6} {p.hours:>7.2f} {fmt_money(p.usd_on_demand):>10} "
            f"{fmt_money(p.usd_spot):>10} {f'{p.loss:.2f} ({p.loss_low:.2f}-{p.loss_high:.2f})':>20} "
            f"{repeats_cell(p):>8}"
            + (f" {core_cell(p):>24}" if with_core else "")
            + f"  {p.hw.throughput_source}"
        )
    if plans:
        lines.append(
            f"loss: {plans[0].law}; interval: "
            + (
                "the calibration fit's RMSE"
                if "calibrated on" in plans[0].law
                else "the Hoffmann et al. 2022 and Besiroglu et al. 2024 fits"
            )
            + ". Spot adds "
            f"{plans[0].spot_overhead:.1%} expected overhead (lost work + restarts)."
        )
    if with_core and core is not None:
        lines.append(core_footer(core))
    lines += price_lines(plans[:top])
    if corpus is not None:
        lines.append(f"epochs: of the corpus's {corpus}")
    if any(p.epochs > 1 for p in plans[:top]):
        lines.append(
            "repeats: what the corpus's size costs in loss, the plan's loss minus its loss had every token been "
            "fresh (Muennighoff et al. 2023's data-constrained law: repeated tokens, and parameters past what "
            f"the unique tokens support, are worth less; up to ~{USEFUL_EPOCHS:g} epochs nearly as good as "
            f"fresh, at most {1 + REPEAT_SCALE:.1f}x the corpus in fresh tokens); ! past {USEFUL_EPOCHS:g} "
            f"epochs: a larger corpus buys a lower loss for the same money; a budget trains at most "
            f"{WORTHWHILE_EPOCHS:.0f} epochs (a further one is worth under 5% of a fresh one) and may spend less"
        )
    return "\n".join(lines)


def core_header(plans: list[BudgetPlan]) -> str:
    first = next(p.core for p in plans if p.core is not None)
    target = " P(>=target)" if any(p.p_target is not None for p in plans) else ""
    return f"CORE {first.version} ({first.level:.0%}){target}"


def core_cell(p: BudgetPlan) -> str:
    """`0.231 (0.18-0.28)`, and the target's probability when the goal is a CORE."""
    if p.core is None:
        return ""
    cell = f"{p.core.core:.3f} ({p.core.low:.2f}-{p.core.high:.2f})"
    return cell + (f" {p.p_target:.2f}" if p.p_target is not None else "")


def core_footer(core: CoreMap) -> str:
    """What the CORE column is: the map (calibrated or not, and on what), and what to do when it is not."""
    text = f"CORE: the loss interval through the loss-to-CORE map (lm.numbers.core_map): {core.label()}."
    if not core.calibrated:
        text += (
            " Its interval spans most of what the loss could mean on other data and another tokenizer; calibrate "
            "it on your own runs with `lm core-map` (docs/planning.md#core)."
        )
    return text


def price_lines(plans: list[BudgetPlan]) -> list[str]:
    """The date and source of each price the shown plans used (conf/gpu/*.yaml), or that it was given."""
    lines, seen = [], set()
    for p in plans:
        gpu = p.hw.gpu
        if gpu.name in seen:
            continue
        seen.add(gpu.name)
        if p.hw.price_on_demand != gpu.price_on_demand or p.hw.price_spot != gpu.price_spot:
            lines.append(f"price of {gpu.name}: given with --price-per-hour")
        else:
            dated = f"as of {gpu.price_date}" if gpu.price_date else "UNDATED"
            url = next((w.strip("(),;'") for w in gpu.price_source.split() if w.startswith("http")), None)
            source = url or ("unverified" if "unverified" in gpu.price_source else "no source recorded")
            lines.append(f"price of {gpu.name}: {dated}, {source} (conf/gpu/{gpu.name}.yaml says more)")
    return lines


def repeats_cell(p: BudgetPlan) -> str:
    """What the corpus's size costs in loss for a plan past one epoch (`!` past USEFUL_EPOCHS), empty within
    one."""
    if p.epochs <= 1:
        return ""
    return f"+{p.repeat_cost:.2f}{'!' if p.epochs > USEFUL_EPOCHS else ''}"


WRITTEN_BY = "# Written by `lm plan"
"""How the second line of an experiment `lm plan` wrote starts: the files it may overwrite."""


def check_overwrite(path: Path) -> None:
    """Refuse to replace an experiment `lm plan` did not write (the project's phase1.yaml, a user's own file)."""
    if path.is_file() and not any(line.startswith(WRITTEN_BY) for line in path.read_text().splitlines()[:2]):
        raise Refused(
            f"{path} exists and was not written by `lm plan`; nothing was written. Choose another name "
            f"(--name my_plan) or another folder (--out-dir)"
        )


def warmup_steps(steps: int) -> int:
    """The LR warm-up of a plan of `steps`: 5% of it, at most 2,000 steps."""
    return max(1, min(2000, steps // 20))


def experiment_yaml(
    p: BudgetPlan,
    name: str,
    command: str,
    corpus: CorpusSize | None = None,
    *,
    warmup: int | None = None,
    model_fields: dict[str, int | None] | None = None,
    extra: list[str] = (),  # type: ignore[assignment]
) -> str:
    """The plan as a sparse experiment file with phases (warm-up, stable, decay); `corpus`: its size, an
    estimate said so, in a comment. `warmup`: the LR warm-up (default `warmup_steps`); `model_fields`: the
    preset's fields this plan changes (a sibling's shape); `extra`: further lines (whole sections)."""
    warmup = warmup if warmup is not None else warmup_steps(p.steps)
    decay_start = max(warmup + 1, p.steps - int(DECAY_FRACTION * p.steps))
    phases = [("warm-up", warmup), ("stable", decay_start), ("decay", p.steps)]
    phases = [(n, s) for n, s in phases if s <= p.steps]
    gpu = p.hw.gpu.name
    lines = [
        "# @package _global_",
        f"# Written by `{command}` on {date.today().isoformat()}: {p.preset} ({p.params / 1e6:.1f}M) on {gpu},",
        f"# {p.steps:,} steps x {p.tokens_per_step:,} tokens{' (' + p.ramp.describe() + ')' if p.ramp else ''}, "
        f"~{p.hours:.2f} h, {fmt_money(p.usd_on_demand)} on demand, "
        f"expected final loss {p.loss:.2f} ({p.loss_low:.2f}-{p.loss_high:.2f}, {p.law}).",
        *([f"# {'~' if corpus.estimated else ''}{p.epochs:.2f} epochs of {corpus}."] if corpus else []),
        *(
            [
                f"# The repetition costs {p.repeat_cost:.2f} in loss against fresh tokens (Muennighoff et al. 2023)."
            ]
            if p.epochs > 1
            else []
        ),
        f"#   python train.py +experiment={name}",
        "defaults:",
        f"  - override /model: {p.preset}",
        "  - override /activation_checkpointing: " + ("on" if p.ac_every else '"off"'),
        f"  - override /gpu: {gpu}",
        "",
        "run:",
        f"  name: {name}",
        *(
            ["model:", *(f"  {k}: {'null' if v is None else v}" for k, v in model_fields.items())]
            if model_fields
            else []
        ),
        "data:",
        f"  batch_size: {p.micro_batch}",
        f"  seq_len: {p.model.max_seq_len}",
        *([f"  batch_ramp_steps: {p.ramp.steps}", f"  batch_ramp_start: {p.ramp.start}"] if p.ramp else []),
        "trainer:",
        *(["  accelerator: gpu"] if gpu != "cpu" else []),
        f"  max_steps: {p.steps}",
        f"  accumulate_grad_batches: {p.accumulate}",
        f"  val_every_steps: {max(1, min(500, p.steps // 20))}",
        "optim:",
        "  schedule: wsd",
        f"  warmup_steps: {warmup}",
        f"  decay_fraction: {DECAY_FRACTION}",
        f"  total_steps: {p.steps}",
        "checkpoint:",
        f"  every_n_steps: {p.checkpoint_every}",
        "phases:",
        "  phases:",
        *(f"    - {{name: {n}, end_step: {s}}}" for n, s in phases),
        *extra,
    ]
    return "\n".join(lines) + "\n"
