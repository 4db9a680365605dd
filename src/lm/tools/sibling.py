"""The plan's smaller sibling: the same run at half the width, trained first, whose validation curve forecasts
the plan's final loss (`early_stopping.forecast_reference`, lm.numbers.reference).

A sibling qualifies as a reference when it shares what the forecast's key compares: the LR schedule's shape
(warm-up as a fraction of the run, the decay fraction, the floor), the tokens of one optimizer step, the
sequence length and the data order. It trains at the plan's tokens per parameter (the collapse form of Qiu et
al. 2025: curves of compute-matched sizes line up by fraction of the run), so its steps shrink with its
parameters and its cost with their square: half the width is ~1/4 the non-embedding parameters and ~1/16 the
compute. On lm's recorded curves a reference ~3.4x smaller forecast every final loss within 0.024 from 30% of
the run, one ~8x smaller within 0.074 (experiments/2026-11-26-forecast-reference): closer sizes forecast
better, and 1/4 keeps the sibling at ~6% of the plan's cost.
"""

from __future__ import annotations

from dataclasses import replace

from lm.model import ModelConfig
from lm.numbers import cost, memory
from lm.numbers.batch_ramp import BatchRamp
from lm.numbers.loss_law import ChinchillaLaw
from lm.numbers.reference import WARMUP_TOLERANCE
from lm.tools.budget import BudgetPlan, CorpusSize, Hardware, experiment_yaml, run_cost, warmup_steps

MIN_STEPS = 40
"""Fewest steps a sibling trains: 20 validations need at least one step each, and a curve of a handful of
steps carries no decay to map."""


def sibling_model(model: ModelConfig) -> ModelConfig | None:
    """`model` at half the width: half the heads of the same head width (so attention's shape per head and
    RoPE stay), half the key/value heads, the SwiGLU width by the same rule. None when there is no half (one
    head, or key/value heads that would not divide the query heads)."""
    heads = model.n_head // 2
    if heads < 1 or model.n_head % 2:
        return None
    kv = None if model.n_kv_head is None else max(1, model.n_kv_head // 2)
    if kv is not None and heads % kv:
        return None
    ffn = None
    if model.ffn_hidden is not None:
        ffn = max(model.ffn_multiple, round(model.ffn_hidden / 2 / model.ffn_multiple) * model.ffn_multiple)
    return replace(model, d_model=heads * model.head_dim, n_head=heads, n_kv_head=kv, ffn_hidden=ffn)


MATCH = WARMUP_TOLERANCE / 2
"""How close (relative) the sibling's warm-up and ramp, rounded to its whole steps, land to the plan's fractions:
half the key's tolerance, so the plan accepts its sibling as a reference whatever the rounding."""


def whole(fraction: float, steps: int) -> int:
    """`fraction` of `steps` in whole steps (at least one)."""
    return max(1, round(fraction * steps))


def matched_steps(target: int, fractions: list[float], longest: int) -> int:
    """The step count nearest `target` (at least MIN_STEPS, at most `longest`) at which each of `fractions`
    rounds to whole steps within MATCH of itself: a 40-step sibling of a plan warmed up over 2% cannot warm
    up over 0.8 steps, so it trains 48-52 steps instead. `longest` (the plan's own steps) always matches."""

    def fits(s: int) -> bool:
        return all(abs(whole(f, s) / s - f) <= MATCH * f for f in fractions if f > 0)

    target = min(max(MIN_STEPS, target), longest)
    for d in range(longest):
        for s in (target - d, target + d):
            if MIN_STEPS <= s <= longest and fits(s):
                return s
    return longest


def make_sibling(
    p: BudgetPlan, law: ChinchillaLaw, corpus: int, seq_len: int
) -> tuple[BudgetPlan, int] | None:
    """(the sibling as a plan, its LR warm-up steps): `p`'s model at half the width, the same tokens per step,
    micro-batch and accumulation (the key's tokens per step; a smaller model fits the same micro-batch), at
    `p`'s tokens per parameter, its LR warm-up and batch ramp the same fractions of its run as the plan's (its
    steps moved to the nearest count where both round to whole steps within `MATCH`). Throughput is `p`'s scaled by the
    FLOPs per token (the same MFU: optimistic for a smaller model, which reaches less). None when the model has
    no half."""
    model = sibling_model(p.model)
    if model is None:
        return None
    n = memory.parameter_count(model)[0]
    warmup_fraction = warmup_steps(p.steps) / p.steps
    ramp_fraction = p.ramp.steps / p.steps if p.ramp is not None else 0.0
    steps = matched_steps(round(p.steps * n / p.params), [warmup_fraction, ramp_fraction], p.steps)
    rate = p.hw.tokens_per_sec * cost.flops_per_token(p.model, seq_len) / cost.flops_per_token(model, seq_len)
    hw = Hardware(
        p.hw.gpu, rate, f"{p.hw.throughput_source}, scaled by FLOPs/token", p.hw.price_on_demand,
        p.hw.price_spot,
    )  # fmt: skip
    ramp = None
    if p.ramp is not None:
        ramp = replace(p.ramp, steps=whole(ramp_fraction, steps))
    full = BatchRamp(p.micro_batch, seq_len, p.accumulate, 1)
    d = (ramp or full).tokens_through(steps)
    hours, usd = run_cost(d, hw.tokens_per_sec, hw.price_on_demand)
    _, spot = run_cost(d, hw.tokens_per_sec, hw.price_spot)
    loss = law.loss(n, d, corpus)
    half = (p.loss_high - p.loss_low) / 2
    sibling = replace(
        p,
        model=model,
        params=n,
        hw=hw,
        steps=steps,
        hours=hours,
        usd_on_demand=usd,
        usd_spot=spot * (1.0 + p.spot_overhead) if spot is not None else None,
        checkpoint_every=min(p.checkpoint_every, steps),
        storage_gb=p.storage_gb * n / p.params,
        epochs=d / corpus,
        loss=loss,
        loss_low=loss - half,
        loss_high=loss + half,
        repeat_cost=loss - law.loss(n, d),
        ramp=ramp,
    )
    return sibling, whole(warmup_fraction, steps)


def sibling_yaml(
    sibling: BudgetPlan, warmup: int, name: str, plan_name: str, command: str, corpus: CorpusSize | None
) -> str:
    """The sibling's experiment: the plan's file with the half-width model's fields, its own steps, warm-up
    and name, validated every 5% of its run."""
    m = sibling.model
    text = experiment_yaml(
        sibling,
        name,
        command,
        corpus,
        warmup=warmup,
        model_fields={
            "d_model": m.d_model,
            "n_head": m.n_head,
            "n_kv_head": m.n_kv_head,
            "ffn_hidden": m.ffn_hidden,
        },
    )
    lines = text.splitlines()
    lines[1] = lines[1].replace(f": {sibling.preset} (", f": {sibling.preset} at half the width (", 1)
    lines.insert(
        2,
        f"# The smaller sibling of `{plan_name}` (half its width, {sibling.params / 1e6:.1f}M parameters, the same "
        "tokens per parameter, step and schedule shape): run it first; its curve forecasts the plan's final loss.",
    )
    return "\n".join(lines) + "\n"


def reference_lines(sibling_name: str) -> list[str]:
    """The plan's early_stopping section naming its sibling's run directory as the forecast's reference."""
    return [
        "early_stopping:",
        "  forecast_model: auto  # the reference when its run has finished, else the laws (and a warning)",
        f"  forecast_reference: ['${{run.root}}/{sibling_name}']",
    ]


def describe(sibling: BudgetPlan, plan: BudgetPlan, name: str) -> str:
    """The plan's line about its sibling: what it is, what it costs against the plan."""
    share = (
        f", {sibling.usd_on_demand / plan.usd_on_demand:.1%} of the plan's"
        if sibling.usd_on_demand and plan.usd_on_demand
        else ""
    )
    usd = f"${sibling.usd_on_demand:,.2f}" if sibling.usd_on_demand is not None else "unpriced"
    return (
        f"forecast reference: python train.py +experiment={name} first ({sibling.params / 1e6:.1f}M parameters, "
        f"{sibling.steps:,} steps, ~{sibling.hours:.2f} h, {usd}{share}); the plan then forecasts its final "
        "loss from the sibling's curve (early_stopping.forecast_reference)"
    )


def plan_files(
    plan: BudgetPlan,
    name: str,
    command: str,
    corpus: CorpusSize,
    law: ChinchillaLaw,
    seq_len: int,
    with_sibling: bool,
) -> dict[str, tuple[str, str]]:
    """`lm plan`'s experiment files by file name: (text, what the terminal says after "wrote <path>"). With
    `with_sibling`, the plan names its sibling as its forecast reference and the sibling's file comes too; a
    model without a half-width shape is said so and the plan is written alone."""
    made = make_sibling(plan, law, corpus.tokens, seq_len) if with_sibling else None
    sibling_name = f"{name}_sibling"
    extra = reference_lines(sibling_name) if made is not None else []
    missing = with_sibling and made is None
    note = f"\nno sibling: {plan.preset} has no half-width shape (one head, or grouped heads that would not divide)"
    files = {
        f"{name}.yaml": (
            experiment_yaml(plan, name, command, corpus, extra=extra),
            f" (plan 1): python train.py +experiment={name}" + (note if missing else ""),
        )
    }
    if made is not None:
        text = sibling_yaml(*made, sibling_name, name, command, corpus)
        files[f"{sibling_name}.yaml"] = (text, f": {describe(made[0], plan, sibling_name)}")
    return files
