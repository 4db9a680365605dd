"""Reading an ablation's runs back and judging them: final losses over seeds (a diverged seed listed, out of the
paired statistics), each arm's best LR and what its grid's spacing may cost, the tokens ratio (a speed-up from
the baseline's complete runs where the spec trains them; bounds, never observations, where a seed is only
bounded), Holm's correction across every comparison of the spec."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from lm.base.exits import Refused
from lm.numbers.stats import (
    NO_SPREAD,
    Interval,
    crossing_interval,
    difference,
    finite,
    holm,
    holm_verdict,
    mean_bound,
    p_value,
    t_interval,
)
from lm.store import rundir
from lm.tools.ablate.runner import data_key, diverged, finished, machine, recorded, result_file, run_config
from lm.tools.ablate.spec import BASELINE, Job, Shape, Spec


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
    """The validation loss at the run's last step (None until it is evaluated there; inf when it diverged)."""
    seconds_per_step: float | None = None
    shape: str = ""
    lr: dict[str, float] = field(default_factory=dict)


def read_run(job: Job, shape: Shape, out: Path | None = None) -> RunResult:
    """A job's curve and final loss from its result record, else from its TensorBoard events (its speed from its
    cost ledger); a run that ended is recorded then, so the next read, or a campaign continued elsewhere from the
    copied records, need not read (or keep) the run directory."""
    if out is not None and (record := recorded(out, job)) is not None:
        result = RunResult(**record["result"])
        if result.status == "diverged":
            result.final = math.inf  # written as null: JSON has no inf
        return result
    result = read_events(job, shape, out)
    ended = result.status == "diverged" or (result.status == "done" and result.final is not None)
    if out is not None and ended:
        record = {
            "config": run_config(job),
            "steps": job.steps,
            "machine": machine(),
            "data_key": data_key(out),
            "result": asdict(result),
        }
        rundir.write_record(result_file(out, job), record)
    return result


def read_events(job: Job, shape: Shape, out: Path | None = None) -> RunResult:
    """A job's curve and final loss from its TensorBoard events, its speed from its cost ledger."""
    result = RunResult(
        job.name, job.arm, job.seed, job.fraction, "incomplete", shape=job.shape, lr=dict(job.lr)
    )
    if out is not None and diverged(out, job):
        result.status, result.final = "diverged", math.inf
        return result
    result.status = "done" if finished(job) else "incomplete"
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
    is at most that; exactly on it is a reading); (None, False) when no point reaches it."""
    points = sorted(points)
    if not points:
        return None, False
    if points[0][1] <= target:
        return points[0][0], points[0][1] < target
    for (t0, l0), (t1, l1) in itertools.pairwise(points):
        if l1 <= target:
            return t0 + (l0 - target) / (l0 - l1) * (t1 - t0), False
    return None, False


# -- the learning-rate search -------------------------------------------------------------------------------


def lr_scores(results: list[RunResult], key: str) -> dict[float, float | None]:
    """Mean final loss over the given search runs at each value of `key` (inf where any seed diverged; None
    while a run is unfinished)."""
    by_value: dict[float, list[RunResult]] = {}
    for r in results:
        by_value.setdefault(r.lr[key], []).append(r)
    scores: dict[float, float | None] = {}
    for value, runs in sorted(by_value.items()):
        finals = [r.final for r in runs]
        scores[value] = None if any(f is None for f in finals) else math.fsum(finals) / len(finals)
    return scores


def best_value(scores: dict[float, float | None]) -> float | None:
    """The value with the lowest mean final loss, once every value is scored (None before; None when all
    diverged)."""
    if not scores or any(s is None for s in scores.values()):
        return None
    value, score = min(scores.items(), key=lambda kv: kv[1])
    return value if math.isfinite(score) else None


# -- the summary of one shape ---------------------------------------------------------------------------------

MEASURED, UPPER, LOWER = "measured", "upper bound", "lower bound"
"""What a seed's tokens ratio is: read between two complete runs, or only bounded (the true ratio is at most,
or at least, the value)."""


@dataclass
class TokenRatio:
    """Tokens an arm needs for the loss it is compared at, over the baseline's tokens (below 1: it needs fewer).

    Two ways to read it, best first: complete runs at several lengths (`speed-up`, Wen et al. 2025: the
    baseline tokens whose final loss equals the variant's, or the variant's own tokens whose final loss equals
    the baseline's); the arm's validation curve (`curve`), whose points are not decayed, so each seed's reading
    is only an upper bound. Only measured values make an interval; bounds make a
    one-sided bound of the mean, never observations in a t interval."""

    interval: Interval | None
    """The ratio and its 95% interval, when every seed is measured (for `speed-up` a paired t test inverted
    over seeds, lm.numbers.stats.crossing_interval: its coverage is measured in tests/numbers/test_coverage.py)."""
    bound: tuple[str, float] | None = None
    """("at most" | "at least", value): what the bounds say when some seed is only bounded."""
    method: str = "-"
    per_seed: dict[int, float] = field(default_factory=dict)
    status: dict[int, str] = field(default_factory=dict)
    """Per seed: MEASURED, UPPER or LOWER."""
    in_decay: list[int] = field(default_factory=list)
    """Seeds whose curve reached the target inside the arm's LR decay: the reading is mostly the loss gap
    rescaled by the decay's drop, not a count of tokens."""
    open_ends: str = ""
    """`low` / `high` / `both`: the interval's end that falls outside the lengths the runs span is only a bound."""
    left_out: dict[int, str] = field(default_factory=dict)
    """Seeds with a finished run that the ratio could not use, and why (a shorter run diverged or not finished):
    counted in `reached`, never dropped from it."""
    reference: bool = False
    """The baseline against its own seeds: 1 by construction, not a measurement without spread."""

    @property
    def above(self) -> dict[int, float]:
        return {s: v for s, v in self.per_seed.items() if self.status.get(s) == LOWER}

    @property
    def below(self) -> dict[int, float]:
        return {s: v for s, v in self.per_seed.items() if self.status.get(s) == UPPER}

    @property
    def reached(self) -> str:
        n = len(self.per_seed) + len(self.left_out)
        measured = sum(st == MEASURED for st in self.status.values())
        text = f"{measured}/{n} measured"
        if self.left_out:
            text += "; left out: " + ", ".join(f"s{s} ({why})" for s, why in sorted(self.left_out.items()))
        if self.below:
            text += ", at most: " + ", ".join(f"s{s} <= {b:.3f}" for s, b in sorted(self.below.items()))
        if self.above:
            text += ", at least: " + ", ".join(f"s{s} > {b:.3f}" for s, b in sorted(self.above.items()))
        if self.in_decay:
            text += f"; {len(self.in_decay)}/{n} crossings inside the decay"
        return text

    @property
    def text(self) -> str:
        """The ratio as the report writes it: an interval, a bound, or why there is neither."""
        if self.interval is not None and self.reference:
            return f"{self.interval.mean:.3f} (reference)"
        if self.interval is not None and self.interval.no_spread:
            return f"{self.interval.mean:.3f} ({NO_SPREAD}: no interval)"
        if self.interval is not None:
            iv, lo, hi = self.interval, self.interval.low, self.interval.high
            low = f"<={lo:.3f}" if self.open_ends in ("low", "both") else f"{lo:.3f}"
            high = f">={hi:.3f}" if self.open_ends in ("high", "both") else f"{hi:.3f}"
            return f"{iv.mean:.3f}" if iv.n == 1 else f"{iv.mean:.3f} [{low}, {high}]"
        if self.bound is not None:
            return f"{'<=' if self.bound[0] == 'at most' else '>='} {self.bound[1]:.3f} (bound)"
        return "-" if not self.per_seed else "no estimate (bounds both ways)"


def finals(results: list[RunResult], arm: str, fraction: float = 1.0) -> dict[int, float]:
    return {
        r.seed: r.final for r in results if r.arm == arm and r.fraction == fraction and r.final is not None
    }


def seed_unchanged(results: list[RunResult], arm: str) -> bool:
    """Two or more seeds of the arm's full runs ended, and every one left the same validation curve: the seed
    changed nothing (it was never applied), so the seeds are one run repeated, not a sample."""
    curves = {
        tuple(r.val_loss) for r in results if r.arm == arm and r.fraction == 1.0 and r.final is not None
    }
    seeds = {r.seed for r in results if r.arm == arm and r.fraction == 1.0 and r.final is not None}
    return len(seeds) >= 2 and len(curves) == 1


def summarize_seeds(ratio: TokenRatio) -> TokenRatio:
    """The interval from measured seeds alone, else the one-sided bound the bounds allow (a measured value is
    a bound of either kind); none when bounds point both ways."""
    values = list(ratio.per_seed.values())
    kinds = set(ratio.status.values()) - {MEASURED}
    if not kinds:
        ratio.interval = t_interval(values)
    elif len(kinds) == 1:
        side = "upper" if kinds == {UPPER} else "lower"
        value = mean_bound(values, side) if len(values) >= 2 else values[0]
        ratio.bound = ("at most" if side == "upper" else "at least", value)
    return ratio


def token_ratio(
    results: list[RunResult], spec: Spec, arm: str, base_tokens: float, shape: Shape | None = None
) -> TokenRatio:
    """The arm's tokens ratio, by the best method its runs allow (see TokenRatio): complete runs at several
    lengths (`speedup`: the baseline's `fractions.baseline`, or the arm's own), else its curve (upper bounds).
    Where the complete runs only bound it, the curve's bound is reported instead when it is tighter."""
    curve = curve_ratio(results, arm, base_tokens, shape)
    if arm == BASELINE or not (spec.fractions.get(BASELINE) or spec.fractions.get(arm)):
        return curve
    ratio = speedup(results, spec, arm)
    if (
        ratio.interval is not None
        or ratio.bound is None
        or curve.bound is None
        or curve.bound[0] != ratio.bound[0]
    ):
        return ratio
    tighter = min if ratio.bound[0] == "at most" else max
    return curve if tighter(curve.bound[1], ratio.bound[1]) == curve.bound[1] else ratio


def curve_ratio(
    results: list[RunResult], arm: str, base_tokens: float, shape: Shape | None = None
) -> TokenRatio:
    """The tokens at which the arm's validation curve reaches the same seed's baseline final loss, over the
    baseline's tokens: an upper bound per seed (the curve's points are not decayed), exact for the baseline."""
    target = {s: v for s, v in finals(results, BASELINE).items() if math.isfinite(v)}
    ratio = TokenRatio(
        None,
        method="full run's curve" + (" (upper bounds)" if arm != BASELINE else ""),
        reference=arm == BASELINE,
    )
    decay_tokens = None
    if shape is not None and shape.decay_start is not None:
        decay_tokens = shape.tokens_through(shape.decay_start)
    for seed in sorted(set(finals(results, arm)) & set(target)):
        full = next(r for r in results if r.arm == arm and r.seed == seed and r.fraction == 1.0)
        if not math.isfinite(full.final):
            continue  # diverged: no tokens to read (the row lists it)
        points = list(zip(full.tokens, full.val_loss, strict=True))
        tokens, _ = tokens_to_reach(points, target[seed])
        if tokens is None:  # never reached within its run: the ratio is above that run's tokens
            ratio.per_seed[seed], ratio.status[seed] = max(t for t, _ in points) / base_tokens, LOWER
            continue
        ratio.per_seed[seed] = tokens / base_tokens
        # The baseline against its own seeds is 1 by construction; a mid-run point of a curve is not decayed
        # (the tokens to that loss with a decay there are fewer): an upper bound.
        ratio.status[seed] = MEASURED if arm == BASELINE else UPPER
        if arm != BASELINE and decay_tokens is not None and tokens > decay_tokens:
            ratio.in_decay.append(seed)
    return summarize_seeds(ratio)


def baseline_tokens_for(points: list[tuple[float, float]], loss: float) -> tuple[float, str]:
    """The tokens whose final loss equals `loss`, linear in log tokens between complete runs (tokens, final
    loss): (tokens, MEASURED), or the range's edge with "before" / "beyond" when `loss` lies outside what the
    runs span (fewer tokens than the shortest run needs, or more than the longest)."""
    logged = [(math.log(t), v) for t, v in points]
    at, first = tokens_to_reach(logged, loss)
    if at is None:  # below the longest run's loss: more than the longest
        return max(t for t, _ in points), "beyond"
    if first:  # at or above the shortest run's loss: at most the shortest
        return math.exp(at), "before"
    return math.exp(at), MEASURED


def speedup(results: list[RunResult], spec: Spec, arm: str, seed: int = 0) -> TokenRatio:
    """Wen et al. 2025's speed-up, as a tokens ratio read from complete runs (each its own warm-up and decay),
    by whichever lengths the spec trained: the baseline's (`fractions.baseline`: the baseline tokens whose final
    loss equals the variant's, placed between the baseline's lengths) or the arm's own (`fractions.<arm>`: the
    arm's tokens whose final loss equals the baseline's full run). A variant better than the baseline is beyond
    the baseline's lengths (it reaches a loss the baseline's longest run does not), and one worse than the
    baseline never reaches the baseline's loss on its own runs: each side measures what the other can only
    bound. A measured side is reported (the arm's own first); with neither, the more informative bound (the
    farther from 1)."""
    sides = [side for side in (arm, BASELINE) if spec.fractions.get(side)]
    ratios = [complete_runs(results, spec, arm, side, seed) for side in sides]
    measured = [r for r in ratios if r.interval is not None]
    if measured:
        return measured[0]
    bounded = [r for r in ratios if r.bound is not None]
    return max(bounded, key=lambda r: abs(math.log(r.bound[1]))) if bounded else ratios[0]


def complete_runs(results: list[RunResult], spec: Spec, arm: str, side: str, seed: int = 0) -> TokenRatio:
    """The tokens ratio from `side`'s complete runs at several lengths (the baseline's or the arm's own), in log
    tokens. The estimate is from the means over seeds (paired seeds only: those where every run of both arms
    used is finite), its interval the tokens at which a paired t test over those seeds does not reject "the
    runs' loss there equals the target" (`crossing_interval`: exact coverage under normal seed noise; the
    percentile bootstrap it replaces covered 83-84% at 5 seeds for a nominal 95%); per seed, the same against
    that seed's runs (the ladder's trend resamples them). Outside `side`'s lengths a value is a bound."""
    lengths = sorted({1.0, *spec.fractions[side]})
    other = arm if side == BASELINE else BASELINE
    ladder = {f: finals(results, side, f) for f in lengths}
    target = finals(results, other)

    def tokens_of(name: str, f: float) -> float | None:
        return next((r.tokens[-1] for r in results if r.arm == name and r.fraction == f and r.tokens), None)

    tokens = {f: tokens_of(side, f) for f in lengths}
    full = {name: tokens_of(name, 1.0) for name in (arm, BASELINE)}
    ratio = TokenRatio(None, method=("speed-up: the baseline's" if side == BASELINE else "speed-up: the arm's own")
                       + " complete runs at " + ", ".join(f"{f:g}" for f in lengths)
                       + " of the tokens, interpolated in log tokens (paired t over seeds, inverted)")  # fmt: skip
    if any(t is None for t in [*tokens.values(), *full.values()]):
        return ratio
    seeds = sorted(
        s for s in target
        if math.isfinite(target[s]) and all(math.isfinite(ladder[f].get(s, math.inf)) for f in lengths)
    )  # fmt: skip

    def why(s: int) -> str:
        runs = [
            (other, target),
            *((side if f == 1.0 else f"{side} at {f:g} of the tokens", ladder[f]) for f in lengths),
        ]
        return "; ".join(
            f"{name} {'not finished' if s not in got else 'diverged'}"
            for name, got in runs
            if not math.isfinite(got.get(s, math.inf))
        )

    started = set(target).union(*(ladder[f] for f in lengths))  # seeds with a run that ended
    ratio.left_out = {s: why(s) for s in sorted(started - set(seeds))}
    if not seeds:
        return ratio

    def estimate(chosen: list[int]) -> tuple[float, str]:
        points = [(tokens[f], float(np.mean([ladder[f][s] for s in chosen]))) for f in lengths]
        at, where = baseline_tokens_for(points, float(np.mean([target[s] for s in chosen])))
        return (full[arm] / at, where) if side == BASELINE else (at / full[BASELINE], where)

    # Which bound each edge gives: the baseline's "before" means the arm's tokens are over few baseline tokens
    # (a ratio at least); the arm's own "before" means it needs at most its shortest run.
    kind = {MEASURED: MEASURED, "before": LOWER if side == BASELINE else UPPER,
            "beyond": UPPER if side == BASELINE else LOWER}  # fmt: skip
    for s in seeds:
        value, where = estimate([s])
        ratio.per_seed[s], ratio.status[s] = value, kind[where]
    point, where = estimate(seeds)
    if where != MEASURED:
        ratio.bound = ("at most" if kind[where] == UPPER else "at least", point)
        return ratio
    x = [math.log(tokens[f]) for f in lengths]
    found = crossing_interval(
        x, np.array([[ladder[f][s] for f in lengths] for s in seeds]), [target[s] for s in seeds],
        math.log(full[arm] / point if side == BASELINE else point * full[BASELINE]),
    )  # fmt: skip
    if found is None:
        ratio.interval = Interval(point, point, point, len(seeds))
        return ratio
    lo, hi, lo_open, hi_open = found
    if side == BASELINE:  # the ratio falls as the baseline's tokens grow: the ends swap
        low, high, ends = full[arm] / math.exp(hi), full[arm] / math.exp(lo), (hi_open, lo_open)
    else:
        low, high, ends = math.exp(lo) / full[BASELINE], math.exp(hi) / full[BASELINE], (lo_open, hi_open)
    ratio.interval = Interval(point, low, high, len(seeds), len(seeds) - 1)
    ratio.open_ends = {(True, True): "both", (True, False): "low", (False, True): "high"}.get(ends, "")
    return ratio


def lr_grid_cost(scores: dict[float, float | None], best: float | None) -> float | None:
    """Loss the grid's spacing may cost at its optimum: the best score minus the minimum of the parabola through
    it and its two neighbours in log LR (within them). None when the optimum is on the edge, a neighbour is
    unscored or not finite, or the three points do not curve upward."""
    if best is None:
        return None
    values = sorted(scores)
    i = values.index(best) if best in values else -1
    if i <= 0 or i >= len(values) - 1:
        return None
    xs = [math.log10(v) for v in values[i - 1 : i + 2]]
    ys = [scores[v] for v in values[i - 1 : i + 2]]
    if any(y is None or not math.isfinite(y) for y in ys):
        return None
    a, b, c = np.polyfit(xs, ys, 2)
    if a <= 0:
        return None
    x = min(max(-b / (2 * a), xs[0]), xs[2])
    return max(0.0, float(ys[1] - (a * x * x + b * x + c)))


@dataclass
class ArmRow:
    """One variant against the baseline at one shape."""

    arm: str
    overrides: str
    seeds: int
    final: Interval | None
    delta: Interval | None
    paired: str
    p: float | None
    p_holm: float | None
    verdict: str
    tokens: TokenRatio
    flops_ratio: float
    step_time_ratio: float | None
    usd: float | None
    usd_per_point: float | None
    usd_per_point_ratio: float | None
    usd_to_target_ratio: Interval | None = None
    """Modelled dollars to reach the baseline's final loss, over the baseline's: tokens x FLOPs ratios (FLOPs at
    equal MFU: never a saving on its own)."""
    measured_usd_to_target_ratio: Interval | None = None
    """Measured dollars to the baseline's final loss, over the baseline's, on the machine that timed the steps:
    tokens ratio x seconds-per-step ratio (every arm's steps interleaved in one process; equal tokens per step).
    Its interval is the tokens ratio's, scaled: the step-time ratio's own noise is not in it."""
    fractions: dict[str, Interval | None] = field(default_factory=dict)
    lr: dict[str, float] = field(default_factory=dict)
    shape: str = ""
    params: int = 0
    left_out: list[str] = field(default_factory=list)
    """Seeds out of the paired statistics because a final of either arm is not finite (`baseline s3`)."""
    delta_per_seed: dict[int, float] = field(default_factory=dict)
    lr_grid_cost: float | None = None
    """The larger of the two arms' `lr_grid_cost`s: loss the LR grid's spacing may cost this comparison."""
    family: int = 0
    """Comparisons Holm's correction was taken over (every variant at every shape of the spec)."""
    seed_unchanged: list[str] = field(default_factory=list)
    """The arms of this comparison (the baseline, this arm) whose seeds all left the same curve: no test, the
    verdict is `NO_SPREAD` and the row leaves Holm's family."""

    @property
    def lr_flag(self) -> bool:
        """The LR grid may cost more loss than the difference this row reports."""
        return (
            self.lr_grid_cost is not None
            and self.delta is not None
            and self.lr_grid_cost > abs(self.delta.mean)
        )

    @property
    def tokens_ratio(self) -> Interval | None:
        return self.tokens.interval


def modelled_usd(tokens: float, flops_per_token: float, spec: Spec, gpu) -> float | None:
    """Dollars of `tokens` on the spec's GPU: FLOPs / (MFU x bf16 peak) seconds at its catalog price."""
    from lm.numbers import cost

    price = cost.catalog_price(gpu, spec.pricing)
    if not gpu.peak_bf16_tflops or price is None:
        return None
    seconds = tokens * flops_per_token / (spec.mfu * gpu.peak_bf16_tflops * 1e12)
    return cost.usd(seconds, price[0], 1)


def catalog_gpu(spec: Spec):
    from lm.config.loading import conf_dir
    from lm.numbers import cost

    gpu = cost.load_catalog(conf_dir()).get(spec.gpu)
    if gpu is None:
        raise Refused(f"gpu: {spec.gpu!r} is not in the catalog (conf/gpu/); name one, e.g. h100_sxm")
    return gpu


def summarize(
    spec: Spec, results: list[RunResult], shapes: dict[str, Shape], times: dict[str, float] | None = None,
    lr: dict[str, dict[str, float]] | None = None, shape_name: str = "",
    grid_costs: dict[str, float | None] | None = None,
) -> list[ArmRow]:  # fmt: skip
    """One row per arm that has finished runs at one shape; Holm's correction across its variants (a ladder's
    campaign takes it again across every shape: `judge`). A seed whose final is not finite in either arm leaves
    the paired statistics and is listed in the row."""
    gpu = catalog_gpu(spec)
    base = finals(results, BASELINE)
    target = t_interval([v for v in base.values() if math.isfinite(v)])
    base_shape = shapes[BASELINE]
    times, costs = times or {}, grid_costs or {}
    base_tokens = base_shape.tokens_through(base_shape.steps)
    base_usd = modelled_usd(base_tokens, base_shape.flops_per_token, spec, gpu)
    rows = []
    for arm in spec.arms:
        overrides = spec.arm_overrides(arm, shape_name)
        everything = finals(results, arm)
        mine = finite(everything)
        if not mine:
            continue
        shape = shapes[arm]
        final = t_interval(list(mine.values()))
        left_out = [f"{arm} s{s}" for s in sorted(set(everything) - set(mine))]
        if arm != BASELINE:
            left_out += [f"{BASELINE} s{s}" for s in sorted(set(base) - set(finite(base))) if s in everything]
        delta, paired = difference(everything, base) if arm != BASELINE else (None, "-")
        unchanged = [a for a in dict.fromkeys([BASELINE, arm]) if seed_unchanged(results, a)]
        untested = arm == BASELINE or bool(unchanged)
        shared = sorted(set(mine) & set(finite(base))) if arm != BASELINE else []
        tokens = token_ratio(results, spec, arm, base_tokens, shape)
        flops_ratio = shape.flops_per_token / base_shape.flops_per_token
        usd = modelled_usd(shape.tokens_through(shape.steps), shape.flops_per_token, spec, gpu)
        per_point = usd / (math.log(shape.vocab_size) - final.mean) if usd is not None else None
        base_point = (
            base_usd / (math.log(base_shape.vocab_size) - target.mean) if base_usd and target else None
        )
        step_ratio = times[arm] / times[BASELINE] if arm in times and BASELINE in times else None
        usd_ratio = scaled(tokens.interval, flops_ratio)
        measured_usd = scaled(tokens.interval, step_ratio)
        arm_costs = [costs.get(arm), costs.get(BASELINE)] if arm != BASELINE else []
        known_costs = [c for c in arm_costs if c is not None]
        rows.append(
            ArmRow(
                arm=arm, overrides=" ".join(overrides) or "(base)", seeds=len(mine), final=final, delta=delta,
                paired=paired, p=None if untested else p_value(delta), p_holm=None, verdict="-",
                tokens=tokens, flops_ratio=flops_ratio,
                step_time_ratio=step_ratio,
                usd=usd, usd_per_point=per_point,
                usd_per_point_ratio=per_point / base_point if per_point and base_point else None,
                usd_to_target_ratio=usd_ratio, measured_usd_to_target_ratio=measured_usd,
                fractions={
                    f"{f:g}": t_interval(list(finite(finals(results, arm, f)).values()))
                    for f in spec.fractions.get(arm, [])
                },
                lr=(lr or {}).get(arm, {}), shape=shape_name, params=shape.params, left_out=left_out,
                delta_per_seed={s: everything[s] - base[s] for s in shared},
                lr_grid_cost=max(known_costs) if known_costs else None, seed_unchanged=unchanged,
            )
        )  # fmt: skip
    judge(rows)
    return rows


def scaled(iv: Interval | None, factor: float | None) -> Interval | None:
    """An interval times a known factor (a ratio of FLOPs or of step times), None when either is unknown."""
    if iv is None or factor is None:
        return None
    return Interval(iv.mean * factor, iv.low * factor, iv.high * factor, iv.n)


def judge(rows: list[ArmRow]) -> None:
    """Holm's correction across every comparison in `rows` (all shapes of a ladder together: a spec is one
    family), and each row's verdict from its adjusted p."""
    compared = [r for r in rows if r.arm != BASELINE]
    adjusted = holm({f"{r.shape}/{r.arm}": r.p for r in compared})
    family = sum(r.p is not None for r in compared)
    for r in compared:
        r.p_holm, r.family = adjusted[f"{r.shape}/{r.arm}"], family
        r.verdict = NO_SPREAD if r.seed_unchanged else holm_verdict(r.delta, r.p_holm)
