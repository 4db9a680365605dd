"""The ablation's report: `ablation.md` (tables per shape, the LR search, the ladder's trend), `.csv`, `.json`
and the plots (loss against tokens, loss against LR, the gain against model size)."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lm.numbers.stats import NO_SPREAD, Interval
from lm.store.atomic import write_atomic
from lm.tools.ablate.analysis import ArmRow, RunResult
from lm.tools.ablate.ladder import NEAR_TARGET, Trend
from lm.tools.ablate.spec import BASELINE, Shape, Spec, lr_tag


@dataclass
class ShapeReport:
    """Everything the report says about one shape (one rung of the ladder, or the only one)."""

    name: str
    shapes: dict[str, Shape]
    results: list[RunResult]
    """The final runs: each arm at its best LR, every seed."""
    rows: list[ArmRow] = field(default_factory=list)
    search: dict[str, dict[float, float | None]] = field(default_factory=dict)
    """Per arm: mean final loss over the search seeds at each value of its tuned key (inf: diverged)."""
    keys: dict[str, str] = field(default_factory=dict)
    best: dict[str, dict[str, float]] = field(default_factory=dict)
    bracketed: dict[str, bool] = field(default_factory=dict)


def fmt_interval(x: Interval | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if x.n == 1:
        return f"{x.mean:.{digits}f} (1 seed)"
    if x.no_spread:  # a zero-width "[a, a]" would read as a precise measurement
        return f"{x.mean:.{digits}f} ({NO_SPREAD})"
    return f"{x.mean:.{digits}f} [{x.low:.{digits}f}, {x.high:.{digits}f}]"


def fmt_ratio(x: float | None) -> str:
    return f"{x:.3f}x" if x is not None else "-"


def fmt_p(p: float | None) -> str:
    return "-" if p is None else f"{p:.3g}"


def header(spec: Spec, report: ShapeReport) -> list[str]:
    base = report.shapes[BASELINE]
    done = sum(r.status == "done" for r in report.results)
    title = f"## Shape `{report.name}`" if report.name else "## Results"
    return [
        title,
        "",
        f"{base.params:,} non-embedding parameters; {base.steps} steps x {base.tokens_per_step:,} tokens "
        f"({base.tokens_through(base.steps):,} tokens a run, {base.tokens_through(base.steps) / base.params:.2f} "
        f"per parameter); {done}/{len(report.results)} final runs done.",
        "",
    ]


def lr_table(report: ShapeReport) -> list[str]:
    if not report.search:
        return []
    lines = ["### Learning rate: mean final loss over the search seeds", "",
             "| arm | key | value: loss (inf = diverged, ... = running) | best | bracketed |", "|---|---|---|---|---|"]  # fmt: skip
    for arm, scores in report.search.items():
        cells = ", ".join(f"{v:g}: {'...' if s is None else f'{s:.4f}'}" for v, s in sorted(scores.items()))
        best = report.best.get(arm, {}).get(report.keys[arm])
        mark = "pending" if best is None else "yes" if report.bracketed.get(arm) else "**no**"
        lines.append(
            f"| {arm} | `{report.keys[arm]}` | {cells} | {'-' if best is None else f'{best:g}'} | {mark} |"
        )
    return [*lines, ""]


def arm_table(spec: Spec, report: ShapeReport) -> list[str]:
    lines = [
        "| arm | overrides | LR | seeds | final val loss [95% CI] | Δ vs baseline [95% CI] | p | p (Holm) | verdict | "
        "left out (not finite) | LR grid cost | tokens for the same loss, x [95% CI or bound] | seeds | "
        "FLOPs/token x | s/step x (measured) | measured $ to baseline's final, x [95% CI] (tokens x s/step) | "
        "modelled $ to baseline's final, x [95% CI] (tokens x FLOPs) | modelled $ / loss point | x |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.rows:
        delta = fmt_interval(r.delta) + (" (Welch)" if r.paired == "welch" else "")
        lr = " ".join(f"{lr_tag(k)}={v:g}" for k, v in r.lr.items()) or "-"
        cost = "-" if r.lr_grid_cost is None else f"{r.lr_grid_cost:.3f}" + (" **flag**" if r.lr_flag else "")
        usd = fmt_interval(r.usd_to_target_ratio, 3)
        if r.usd_to_target_ratio is None and r.tokens.bound is not None:
            side, value = r.tokens.bound
            usd = f"{'<=' if side == 'at most' else '>='} {value * r.flops_ratio:.3f} (bound)"
        measured = fmt_interval(r.measured_usd_to_target_ratio, 3)
        if r.measured_usd_to_target_ratio is None and r.tokens.bound is not None and r.step_time_ratio:
            side, value = r.tokens.bound
            measured = f"{'<=' if side == 'at most' else '>='} {value * r.step_time_ratio:.3f} (bound)"
        if r.tokens.reference:  # the baseline against itself: 1 by construction
            usd = "1.000 (reference)"
            measured = "-" if r.measured_usd_to_target_ratio is None else usd
        lines.append(
            f"| {r.arm} | `{r.overrides}` | {lr} | {r.seeds} | {fmt_interval(r.final)} | {delta} | {fmt_p(r.p)} | "
            f"{fmt_p(r.p_holm)} | **{r.verdict}** | {', '.join(r.left_out) or '-'} | {cost} | {r.tokens.text} | "
            f"{r.tokens.reached} | {fmt_ratio(r.flops_ratio)} | {fmt_ratio(r.step_time_ratio)} | {measured} | {usd} | "
            f"{'-' if r.usd_per_point is None else f'${r.usd_per_point:.3g}'} | {fmt_ratio(r.usd_per_point_ratio)} |"
        )
    methods = sorted({f"{r.arm}: {r.tokens.method}" for r in report.rows if r.arm != BASELINE})
    if methods:
        lines += ["", "Tokens for the same loss (below 1: the arm needs fewer) were read off: " + "; ".join(methods)
                  + ". A curve's reading is an upper bound (its points are not decayed), and one inside the decay "
                  "mostly rescales the loss gap by the decay's drop; bounds give a one-sided 95% bound of the "
                  "mean, never a t interval."]  # fmt: skip
    flagged = [r.arm for r in report.rows if r.lr_flag]
    if flagged:
        lines += ["", f"**LR grid flag:** the grid's spacing may cost more loss than the difference measured for "
                  f"{', '.join(flagged)} (LR grid cost: the best grid score minus the minimum of the parabola "
                  "through it and its neighbours in log LR, the larger of the two arms')."]  # fmt: skip
    unchanged = sorted({a for r in report.rows for a in r.seed_unchanged})
    if unchanged:
        lines += ["", f"**The seed changed nothing** for {', '.join(unchanged)}: every seed left the same validation "
                  "curve, so the seeds are one run repeated; its comparisons have no test (`no seed spread`, no "
                  "p) and leave Holm's family. Check that the arm's overrides do not pin the seed."]  # fmt: skip
    shorter = [r for r in report.rows if r.fractions]
    if shorter:
        lines += ["", "Shorter runs (each with its own warm-up and decay):", "",
                  "| arm | fraction of the steps | final val loss [95% CI] |", "|---|---|---|"]  # fmt: skip
        for r in shorter:
            lines += [f"| {r.arm} | {f} | {fmt_interval(i)} |" for f, i in r.fractions.items()]
    return [*lines, ""]


def trend_table(trends: list[Trend], spec: Spec) -> list[str]:
    if not trends:
        return []
    target = " ".join(spec.extrapolate_to)
    lines = [
        "## The gain across the ladder",
        "",
        f"Each quantity against non-embedding parameters: a line in log(N) through each shape's mean, its 95% "
        f"interval a percentile bootstrap over each shape's seeds (seed noise only: the line's form is assumed; "
        f"its coverage is not measured, and at 5 seeds such a bootstrap covered 83-84% for a ratio). Beside the "
        f"fit on every rung, the fit without each rung and on the largest rungs; the direction is said only where "
        f"every fit agrees, and says how the gain moves across the rungs measured, nothing beyond them. Target: "
        f"`{target}` ({trends[0].target_params:,} non-embedding parameters); a value there is stated only within "
        f"{NEAR_TARGET:g}x of the largest rung.",
        "",
        "| arm | quantity | per shape (N: mean) | fit | slope per e-fold of N [95%] | direction | "
        "at the target [95%] (extrapolated) | the gain with scale (all fits) | flagged / left-out rungs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in trends:
        rungs = ", ".join(f"{p:,}: {m:+.3f}" if t.quantity != "tokens ratio" else f"{p:,}: {m:.3f}"
                          for p, m in zip(t.params, t.means, strict=True))  # fmt: skip
        notes = []
        if t.flagged:
            notes.append("LR grid costs more than the effects at " + ", ".join(t.flagged))
        if t.left_out:
            notes.append("no measurement at " + ", ".join(t.left_out))
        far = f"not stated: the target is {t.target_params / max(t.params):,.0f}x the largest rung"
        for i, f in enumerate(t.fits):
            head = f"| {t.arm} | {t.quantity} | {rungs} |" if i == 0 else "| | | |"
            tail = f" **{t.direction}** | {'; '.join(notes) or '-'} |" if i == 0 else " | |"
            at = fmt_interval(f.at_target, 3) if t.near_target else far
            lines.append(f"{head} {f.label} | {fmt_interval(f.slope, 3)} | {f.direction} | {at} |{tail}")
    usd = [t for t in trends if t.usd_at_target is not None and t.near_target]
    if usd:
        lines += ["", "Modelled dollars at the target (tokens ratio x FLOPs/token ratio there, the fit on every rung): "
                  + "; ".join(f"{t.arm} {fmt_interval(t.usd_at_target, 3)} (FLOPs x {t.flops_ratio_at_target:.3f})"
                              for t in usd) + "."]  # fmt: skip
    return [*lines, ""]


def markdown(spec: Spec, reports: list[ShapeReport], trends: list[Trend]) -> str:
    lines = [
        f"# Ablation `{spec.name}`",
        "",
        f"Base: `{' '.join(spec.base) or '(defaults)'}`; seeds {spec.seeds}"
        + (f"; LR searched on seeds {spec.search_seeds}, every arm then at its own best" if spec.lr else "")
        + ".",
        "Intervals are 95% Student t over seeds; Δ is variant - baseline, paired by seed (a seed whose final is not "
        "finite in either arm leaves the pair and is listed); p is the paired t test's, Holm-adjusted across "
        f"every comparison of the spec, all shapes together ({family(reports)} tests; the verdict uses the "
        "adjusted p < 0.05). The tokens ratio's interval from complete runs inverts a paired t test over seeds "
        "(its coverage at 3, 5 and 8 seeds is measured in tests/numbers/test_coverage.py). Measured dollars are the "
        "tokens ratio x the seconds-per-step ratio (medians of all arms' steps interleaved in one process on this "
        "machine, `step_times.json`): what the arm saves here. Modelled dollars are FLOPs / (MFU "
        f"{spec.mfu:g} x {spec.gpu}'s bf16 peak) at its {spec.pricing} price, every arm at the same MFU: a "
        "FLOP count, never a saving on its own. A loss point is the drop from a uniform guess (ln V) to the final "
        "loss.",
        "",
        *trend_table(trends, spec),
    ]
    for report in reports:
        lines += [*header(spec, report), *lr_table(report), *arm_table(spec, report)]
    lines += ["## Runs", "", "| run | status | final val loss | s/step |", "|---|---|---|---|"]
    for report in reports:
        for r in report.results:
            final = "-" if r.final is None else f"{r.final:.4f}"
            speed = "-" if r.seconds_per_step is None else f"{r.seconds_per_step:.3f}"
            lines.append(
                f"| {report.name + '/' if report.name else ''}{r.job} | {r.status} | {final} | {speed} |"
            )
    return "\n".join(lines) + "\n"


def family(reports: list[ShapeReport]) -> int:
    return max((r.family for rep in reports for r in rep.rows), default=0)


def triple(x: Interval | None) -> tuple[Any, Any, Any]:
    return (x.mean, x.low, x.high) if x is not None else (None, None, None)


def csv_text(reports: list[ShapeReport]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow([
        "shape", "params", "variant", "overrides", "lr", "seeds", "final_mean", "final_low", "final_high",
        "delta_mean", "delta_low", "delta_high", "p", "p_holm", "holm_family", "verdict", "left_out",
        "lr_grid_cost", "lr_flag", "tokens_method", "tokens_ratio_mean", "tokens_ratio_low", "tokens_ratio_high",
        "tokens_bound", "reached", "flops_ratio", "step_time_ratio", "modelled_usd",
        "modelled_usd_per_loss_point", "usd_per_point_ratio", "usd_to_target_ratio_mean",
        "usd_to_target_ratio_low", "usd_to_target_ratio_high", "measured_usd_to_target_ratio_mean",
        "measured_usd_to_target_ratio_low", "measured_usd_to_target_ratio_high",
    ])  # fmt: skip
    for report in reports:
        for r in report.rows:
            writer.writerow([
                report.name, r.params, r.arm, r.overrides, json.dumps(r.lr), r.seeds, *triple(r.final),
                *triple(r.delta), r.p, r.p_holm, r.family, r.verdict, " ".join(r.left_out), r.lr_grid_cost,
                r.lr_flag, r.tokens.method, *triple(r.tokens_ratio),
                "" if r.tokens.bound is None else f"{r.tokens.bound[0]} {r.tokens.bound[1]:.6g}", r.tokens.reached,
                r.flops_ratio, r.step_time_ratio, r.usd, r.usd_per_point, r.usd_per_point_ratio,
                *triple(r.usd_to_target_ratio), *triple(r.measured_usd_to_target_ratio),
            ])  # fmt: skip
    return buf.getvalue()


def figure_bytes(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(path: Path, spec: Spec, reports: list[ShapeReport]) -> None:
    """Validation loss against tokens per shape: each arm's mean over seeds, the band from its lowest to
    highest seed."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(reports), figsize=(7 * len(reports), 5), squeeze=False)
    for ax, report in zip(axes[0], reports, strict=True):
        lows = []
        for arm in spec.arms:
            runs = [r for r in report.results if r.arm == arm and r.fraction == 1.0 and r.final is not None]
            runs = [r for r in runs if math.isfinite(r.final)]
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
        ax.set_title(f"{spec.name} {report.name}: mean over seeds, band = min..max")
        ax.legend()
    write_atomic(path, figure_bytes(fig))


def plot_lr(path: Path, spec: Spec, reports: list[ShapeReport]) -> None:
    """Final loss against the tuned value, one panel per shape: a reader sees each optimum is bracketed."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.5), squeeze=False)
    for ax, report in zip(axes[0], reports, strict=True):
        for arm, scores in report.search.items():
            points = sorted((v, s) for v, s in scores.items() if s is not None and math.isfinite(s))
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=f"{arm} ({lr_tag(report.keys[arm])})")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (the arm's tuned key)")
        ax.set_ylabel("final val loss (search seeds' mean)")
        ax.set_title(f"{report.name or spec.name}")
        ax.legend(fontsize=8)
    write_atomic(path, figure_bytes(fig))


def plot_trend(path: Path, trends: list[Trend]) -> None:
    """Each quantity against non-embedding parameters, with the extrapolated point at the target (one panel
    per quantity)."""
    plt = pyplot()
    quantities = sorted({t.quantity for t in trends})
    fig, axes = plt.subplots(1, len(quantities), figsize=(7 * len(quantities), 4.5), squeeze=False)
    for ax, quantity in zip(axes[0], quantities, strict=True):
        for t in (t for t in trends if t.quantity == quantity):
            (line,) = ax.plot(t.params, t.means, marker="o", label=f"{t.arm} ({t.direction})")
            if not t.near_target:
                continue
            ax.errorbar([t.target_params], [t.at_target.mean], fmt="s", color=line.get_color(),
                        yerr=[[t.at_target.mean - t.at_target.low], [t.at_target.high - t.at_target.mean]])  # fmt: skip
            ax.plot(
                [t.params[-1], t.target_params],
                [t.means[-1], t.at_target.mean],
                ls=":",
                color=line.get_color(),
            )
        ax.axhline(1.0 if quantity == "tokens ratio" else 0.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(
            f"non-embedding parameters (square: the target, where within {NEAR_TARGET:g}x of the largest rung)"
        )
        ax.set_ylabel(quantity)
        ax.legend(fontsize=8)
    write_atomic(path, figure_bytes(fig))


def write_report(out: Path, spec: Spec, reports: list[ShapeReport], trends: list[Trend]) -> Path:
    """(Re)write ablation.md / .csv / .json and the plots."""
    md = out / "ablation.md"
    write_atomic(md, markdown(spec, reports, trends))
    write_atomic(out / "ablation.csv", csv_text(reports))
    rows = [asdict(r) for rep in reports for r in rep.rows]
    runs = [asdict(r) for rep in reports for r in rep.results]
    search = {
        rep.name: {arm: {f"{v:g}": s for v, s in sc.items()} for arm, sc in rep.search.items()}
        for rep in reports
    }
    record = {"spec": asdict(spec), "rows": rows, "runs": runs, "lr_search": search,
              "trends": [asdict(t) for t in trends]}  # fmt: skip
    write_atomic(out / "ablation.json", json.dumps(record, indent=1, default=str))
    if any(rep.rows for rep in reports):
        plot_curves(out / "ablation.png", spec, [rep for rep in reports if rep.rows])
    if any(rep.search for rep in reports):
        plot_lr(out / "lr.png", spec, [rep for rep in reports if rep.search])
    if trends:
        plot_trend(out / "ladder.png", trends)
    return md
