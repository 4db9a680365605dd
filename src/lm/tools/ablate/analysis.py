"""Reading an ablation's runs back and judging them: final losses over seeds, each arm's best LR, tokens to the
baseline's final loss seed by seed (censored seeds kept, never dropped), Holm's correction across the arms."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lm.base.exits import Refused
from lm.numbers.stats import Interval, difference, holm, holm_verdict, p_value, t_interval
from lm.store import rundir
from lm.tools.ablate.runner import diverged, finished, machine, recorded, result_file, run_config
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


@dataclass
class TokenRatio:
    """Tokens an arm needs to reach its seed's baseline final loss, over the baseline's tokens, seed by seed."""

    interval: Interval | None
    """t interval over seeds; a censored seed enters at its bound."""
    above: dict[int, float] = field(default_factory=dict)
    """Seeds that never reached their target: the ratio is above this bound."""
    below: dict[int, float] = field(default_factory=dict)
    """Seeds already below the target at the first point read: the ratio is at most this bound."""
    method: str = "-"
    per_seed: dict[int, float] = field(default_factory=dict)

    @property
    def reached(self) -> str:
        n = len(self.per_seed)
        text = f"{n - len(self.above)}/{n}"
        if self.above:
            text += ", censored above: " + ", ".join(f"s{s} > {b:.2f}" for s, b in sorted(self.above.items()))
        if self.below:
            text += ", censored below: " + ", ".join(
                f"s{s} <= {b:.2f}" for s, b in sorted(self.below.items())
            )
        return text


def finals(results: list[RunResult], arm: str, fraction: float = 1.0) -> dict[int, float]:
    return {
        r.seed: r.final for r in results if r.arm == arm and r.fraction == fraction and r.final is not None
    }


def token_ratio(results: list[RunResult], spec: Spec, arm: str, base_tokens: float) -> TokenRatio:
    """Per seed: the tokens at which `arm` reaches the baseline's final loss of the SAME seed (so the target's
    own seed-to-seed spread is in the interval), over the baseline's tokens. Read off the arm's shorter runs'
    final losses (each decayed) when the spec has `fractions` for it, else off its full run's curve, whose
    decay is still ahead mid-run (an upper bound)."""
    target = finals(results, BASELINE)
    use_fractions = bool(spec.fractions.get(arm)) and arm != BASELINE
    ratio = TokenRatio(None)
    ratio.method = "shorter runs' final losses (each decayed)" if use_fractions else "full run's curve"
    if arm != BASELINE and not use_fractions:
        ratio.method += " (upper bound)"
    for seed in sorted(set(finals(results, arm)) & set(target)):
        runs = [r for r in results if r.arm == arm and r.seed == seed and r.final is not None]
        full = next(r for r in runs if r.fraction == 1.0)
        if not math.isfinite(full.final):
            continue  # diverged: no tokens to read
        if use_fractions:
            points = [(r.tokens[-1], r.final) for r in runs if math.isfinite(r.final)]
        else:
            points = list(zip(full.tokens, full.val_loss, strict=True))
        tokens, below = tokens_to_reach(points, target[seed])
        if tokens is None:  # never reached within its longest run: the ratio is above that run's tokens
            ratio.above[seed] = max(t for t, _ in points) / base_tokens
            ratio.per_seed[seed] = ratio.above[seed]
            continue
        ratio.per_seed[seed] = tokens / base_tokens
        if below:
            ratio.below[seed] = ratio.per_seed[seed]
    ratio.interval = t_interval(list(ratio.per_seed.values()))
    return ratio


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
    """Modelled dollars to reach the baseline's final loss, over the baseline's: tokens x FLOPs ratios."""
    fractions: dict[str, Interval | None] = field(default_factory=dict)
    lr: dict[str, float] = field(default_factory=dict)
    shape: str = ""
    params: int = 0

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
) -> list[ArmRow]:  # fmt: skip
    """One row per arm that has finished runs at one shape; Holm's correction across the variants."""
    gpu = catalog_gpu(spec)
    base = finals(results, BASELINE)
    target = t_interval([v for v in base.values() if math.isfinite(v)])
    base_shape = shapes[BASELINE]
    times = times or {}
    base_tokens = base_shape.tokens_through(base_shape.steps)
    base_usd = modelled_usd(base_tokens, base_shape.flops_per_token, spec, gpu)
    rows = []
    for arm in spec.arms:
        overrides = spec.arm_overrides(arm, shape_name)
        mine = {s: v for s, v in finals(results, arm).items() if math.isfinite(v)}
        if not mine:
            continue
        shape = shapes[arm]
        final = t_interval(list(mine.values()))
        delta, paired = difference(mine, base) if arm != BASELINE else (None, "-")
        tokens = token_ratio(results, spec, arm, base_tokens)
        flops_ratio = shape.flops_per_token / base_shape.flops_per_token
        usd = modelled_usd(shape.tokens_through(shape.steps), shape.flops_per_token, spec, gpu)
        per_point = usd / (math.log(shape.vocab_size) - final.mean) if usd is not None else None
        base_point = (
            base_usd / (math.log(base_shape.vocab_size) - target.mean) if base_usd and target else None
        )
        rows.append(
            ArmRow(
                arm=arm, overrides=" ".join(overrides) or "(base)", seeds=len(mine), final=final, delta=delta,
                paired=paired, p=p_value(delta) if arm != BASELINE else None, p_holm=None, verdict="-",
                tokens=tokens, flops_ratio=flops_ratio,
                step_time_ratio=times[arm] / times[BASELINE] if arm in times and BASELINE in times else None,
                usd=usd, usd_per_point=per_point,
                usd_per_point_ratio=per_point / base_point if per_point and base_point else None,
                usd_to_target_ratio=t_interval([t * flops_ratio for t in tokens.per_seed.values()]),
                fractions={
                    f"{f:g}": t_interval(list(finals(results, arm, f).values()))
                    for f in spec.fractions.get(arm, [])
                },
                lr=(lr or {}).get(arm, {}), shape=shape_name, params=shape.params,
            )
        )  # fmt: skip
    adjusted = holm({r.arm: r.p for r in rows if r.arm != BASELINE})
    for r in rows:
        if r.arm != BASELINE:
            r.p_holm = adjusted[r.arm]
            r.verdict = holm_verdict(r.delta, r.p_holm)
    return rows
