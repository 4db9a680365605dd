"""`lm report RUN_DIR`: report.md and PNG plots of what a run cost and what it bought.

Reads only what the run left on disk (TensorBoard events, phases.csv, the cost ledger, config.yaml), so it
works on a finished run, a running one, or one copied off a dead machine.
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training box
import matplotlib.pyplot as plt
import numpy as np

from lm.base.scores import core_markdown, core_name, gain, gain_text, is_core, pm
from lm.base.tables import cell, evals_markdown, fmt_money, main_metric, phases_markdown
from lm.numbers.cost import FLOPS_FORMULA
from lm.store import rundir
from lm.store.atomic import open_atomic, write_atomic
from lm.store.rundir import BUCKETS, Series

log = logging.getLogger(__name__)


def write_report(run_dir: str | Path) -> Path:
    """Write `report.md` and its plots into `run_dir`; returns the report's path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a run directory; pass runs/<run.name>")
    scalars = rundir.read_scalars(run_dir)
    rows = rundir.read_phases(run_dir)
    ledger = rundir.read_ledger(run_dir)
    cfg = rundir.read_config(run_dir)
    evals = rundir.read_evals(run_dir)

    plots = [
        headline_plot(scalars, ledger, run_dir, rows),
        plot_scores_vs_usd(evals, run_dir / "accuracy_vs_usd.png"),
        plot_loss_vs(scalars, "train/tokens", "tokens trained", run_dir / "loss_vs_tokens.png", rows),
        plot_throughput(scalars, run_dir / "throughput.png"),
        plot_cost_breakdown(ledger, run_dir / "cost_breakdown.png"),
    ]
    rollbacks = rundir.read_record(run_dir / rundir.CHECKPOINTS / rundir.ROLLBACKS)
    remote = rundir.read_record(run_dir / rundir.REMOTE)
    plots = [p for p in plots if p is not None]
    text = render(run_dir.name, cfg, scalars, rows, ledger, plots, rollbacks, remote, evals)
    stop, forecast = rundir.read_record(run_dir / rundir.STOP), rundir.read_record(run_dir / rundir.FORECAST)
    measured = float(scalars["val/loss"].values[-1]) if "val/loss" in scalars else None
    decided = (stop or {}).get("forecast")  # what the stopper saw when it decided, else the latest
    schedule = decided or (forecast or {}).get("schedule")
    text += stopping_section(stop, schedule) + forecast_section(schedule, measured, bool(decided))
    text += reference_section((forecast or {}).get("reference"))
    text += core_forecast_section((forecast or {}).get("core"))
    text += benchmarks_section(evals, rundir.read_record(run_dir / rundir.EVAL))
    text += samples_section(rundir.read_samples(run_dir))
    text += failures_section(evals, rundir.read_failures(run_dir))
    path = run_dir / "report.md"
    write_atomic(path, text)
    return path


UNPRICED = "unpriced: this machine has no catalogued price (a CPU is $0/h); set cost.price_per_hour=<$/h> to meter it"


def priced(ledger: dict | None) -> bool:
    """Whether the run's time was priced (a catalogued GPU, or `cost.price_per_hour`); a CPU run is not."""
    return bool(ledger and ledger.get("price_per_hour"))


def headline_plot(
    scalars: dict[str, Series], ledger: dict | None, run_dir: Path, rows: list[dict]
) -> Path | None:
    """Loss against dollars; an unpriced run's against hours (its dollars are all $0: no axis to read)."""
    if priced(ledger) or "cost/hours" not in scalars:
        (run_dir / "loss_vs_hours.png").unlink(missing_ok=True)
        return plot_loss_vs(scalars, "cost/usd", "dollars spent", run_dir / "loss_vs_usd.png", rows)
    (run_dir / "loss_vs_usd.png").unlink(missing_ok=True)
    label = "wall-clock hours (unpriced: set cost.price_per_hour to plot dollars)"
    return plot_loss_vs(scalars, "cost/hours", label, run_dir / "loss_vs_hours.png", rows)


def render(
    name,
    cfg,
    scalars,
    rows,
    ledger,
    plots: list[Path],
    rollbacks: dict | None = None,
    remote: dict | None = None,
    evals: list[dict] | None = None,
) -> str:
    """The report's Markdown."""
    lines = [f"# Run report: {name}", ""]
    if remote and not remote["holds"]:  # first: the run's resumability is at stake
        lines += [
            f"> **The bucket is behind:** {remote['url']} does not hold step {remote['step']}: {remote['why']}",
            "",
        ]
    summary = headline(cfg, scalars, ledger, rollbacks)
    if summary:
        lines += ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in summary.items()], ""]
    beside = [p for p in plots if p.name in ("loss_vs_usd.png", "loss_vs_hours.png", "accuracy_vs_usd.png")]
    if beside:
        lines += [" ".join(f"![{p.stem.replace('_vs_', ' against ')}]({p.name})" for p in beside), ""]
    plots = [p for p in plots if p not in beside]
    lines += ["## Phases", ""]
    benchmark = phase_benchmarks(rows, evals) if evals else None
    lines += (
        [phases_markdown(rows, benchmark, priced(ledger) or not ledger), ""]
        if rows
        else ["No phase has finished yet.", ""]
    )
    if ledger:
        lines += [
            "## Where the money went",
            "",
            "| time spent on | hours | dollars | share |",
            "|---|---|---|---|",
        ]
        total = sum(ledger["seconds"].values()) or 1.0
        price, devices = ledger.get("price_per_hour"), ledger.get("devices", 1)
        for bucket in BUCKETS:
            seconds = ledger["seconds"].get(bucket, 0.0)
            money = fmt_money(seconds * price * devices / 3600) if priced(ledger) else "unpriced"
            lines.append(f"| {bucket} | {seconds / 3600:.4g} | {money} | {seconds / total:.1%} |")
        lines += ["", "`restart` is a resumed process's start-up plus the work redone after a restart.", ""]
        if not priced(ledger):
            lines += [f"Dollars: {UNPRICED} when you run it.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    lines += ["", f"MFU uses {FLOPS_FORMULA} against the catalog's dense peak for the run's precision.", ""]
    return "\n".join(lines)


def headline(cfg, scalars, ledger, rollbacks: dict | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    about = (ledger or {}).get("run", {})
    if cfg is not None:
        m = cfg.model
        out["model"] = (
            f"{about['params']:,} parameters: " if "params" in about else ""
        ) + f"{m.n_layer} layers x {m.d_model} wide, vocabulary {m.vocab_size}, context {m.max_seq_len}"
    if about:
        out["device"] = f"{about['device']} (catalog entry: {about['gpu']}, {about['pricing']} pricing)"
        out["precision / compile / activation checkpointing"] = (
            f"{about['precision']} / {about['compile']} / {about['activation_checkpointing'] or 'off'}"
        )
    if "train/tokens" in scalars:
        out["tokens trained"] = f"{int(scalars['train/tokens'].values[-1]):,}"
    if "val/loss" in scalars:
        val = scalars["val/loss"]
        first, last = (
            f"{val.values[0]:.3f} (step {val.steps[0] + 1})",
            f"{val.values[-1]:.3f} (step {val.steps[-1] + 1})",
        )
        out["validation loss"] = f"{first} -> {last}"
    for tag in sorted(t for t in scalars if t.startswith("val/loss/")):  # each source of a data mixture
        out[f"validation loss, {tag.removeprefix('val/loss/')}"] = (
            f"{scalars[tag].values[0]:.3f} -> {scalars[tag].values[-1]:.3f}"
        )
    if ledger and not priced(ledger):
        out["dollars"] = UNPRICED
    elif ledger and ledger.get("usd") is not None:
        out["dollars"] = (
            f"{fmt_money(ledger['usd'])} at ${ledger['price_per_hour']}/h x {ledger.get('devices', 1)}"
        )
        if ledger.get("tokens"):
            out["$ per billion tokens (all in)"] = fmt_money(ledger["usd"] / ledger["tokens"] * 1e9)
    if "perf/tokens_per_sec" in scalars:
        out["training tokens/s (median)"] = f"{np.median(scalars['perf/tokens_per_sec'].values):,.0f}"
    out["MFU (median)"] = (
        f"{np.median(scalars['perf/mfu'].values):.1%}"
        if "perf/mfu" in scalars
        else "n/a (no catalogued peak)"
    )
    if "train/spikes" in scalars:
        out["loss spikes skipped"] = spikes_line(scalars["train/spikes"], rollbacks or {})
    if ledger:
        out["wall-clock hours (all processes)"] = f"{sum(ledger['seconds'].values()) / 3600:.4g}"
    return out


def spikes_line(spikes: Series, rollbacks: dict) -> str:
    """How many loss spikes were skipped (`train/spikes`), and the data windows that rollbacks skipped."""
    text = f"{int(spikes.values[-1])} (a loss above guards.spike_factor x its running median)"
    windows = rollbacks.get("skip_windows", [])
    if windows:
        steps = ", ".join(f"{first}-{last}" for first, last in windows)
        text += f"; {len(windows)} rollback(s) skipped the data of steps {steps}"
    return text


def plot_loss_vs(
    scalars: dict[str, Series], x_tag: str, x_label: str, path: Path, rows: list[dict] | None = None
) -> Path | None:
    """Validation (and smoothed training) loss against a cumulative quantity logged per step."""
    if x_tag not in scalars or len(scalars[x_tag]) < 2:
        return None
    x = scalars[x_tag]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if "train/loss" in scalars:
        train = scalars["train/loss"]
        ax.plot(x.at(train.steps), smooth(train.values), color="0.6", lw=1, label="train (smoothed)")
    if "val/loss" in scalars:
        val = scalars["val/loss"]
        ax.plot(x.at(val.steps), val.values, "o-", color="C0", label="validation")
    ends = [
        (float(x.at(np.array([r["end_step"] - 1]))[0]), r["name"])
        for r in rows or []
        if r["status"] == "done"
    ]
    for at, names in phase_labels(ends, float(np.ptp(x.values))):  # phase ends, at their last step's x
        ax.axvline(at, color="C3", ls="--", lw=0.8)
        ax.annotate(names, (at, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                    fontsize=8)  # fmt: skip
    ax.set_xlabel(x_label)
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with open_atomic(path) as f:  # a full disk: DiskFull (exit 74), no half-written png
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return path


LABEL_GAP = 0.04
"""Phase ends closer than this share of the x range share one label (their names joined): none overlap."""


def phase_labels(ends: list[tuple[float, str]], span: float) -> list[tuple[float, str]]:
    """(x, names) per label: phase ends within `LABEL_GAP` of the x range of the label before are merged into
    it, at the last one's x."""
    labels: list[tuple[float, list[str]]] = []
    for at, name in sorted(ends):
        if labels and at - labels[-1][0] <= LABEL_GAP * span:
            labels[-1] = (at, [*labels[-1][1], name])
        else:
            labels.append((at, [name]))
    return [(at, " / ".join(names)) for at, names in labels]


def mean_score(record: dict) -> float | None:
    """A milestone's headline: CORE where it was scored, else the mean over its tasks of each task's main
    metric (acc_norm, else acc)."""
    if record.get("core"):
        return record["core"]["value"]
    values = [m[main_metric(m)] for t, m in record["scores"].items() if main_metric(m) and not is_core(t)]
    return float(np.mean(values)) if values else None


def phase_benchmarks(rows: list[dict], evals: list[dict]) -> list[str]:
    """Per phase row: the benchmark score at its end (CORE where scored, else the mean accuracy) and what the
    phase added since its start (the previous boundary's evaluation), i.e. what the phase's money bought:
    for CORE, the dollars per 0.01 CORE."""
    by_step = {r["step"]: r for r in evals}
    out = []
    for row in rows:
        end_record, start_record = by_step.get(row["end_step"]), by_step.get(row["start_step"])
        end = mean_score(end_record) if end_record else None
        start = mean_score(start_record) if start_record else None
        if end is None:
            out.append("")
            continue
        core = end_record.get("core")
        cell = f"{core_name(core)} {pm(core)}" if core else f"{end:.1%}"
        moved = gain(core, start_record.get("core")) if core and start_record else None
        if moved is not None:
            cell += f" ({gain_text(*moved, row.get('usd'), fmt_money)})"
        elif start is not None and not core:
            cell += f" ({(end - start) * 100:+.1f} pts)"
        out.append(cell)
    return out


def plot_scores_vs_usd(evals: list[dict], path: Path) -> Path | None:
    """Each task's main metric at each milestone against the dollars spent by then."""
    points = [r for r in evals if r.get("usd") is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for task in dict.fromkeys(t for r in points for t in r["scores"]):
        mine = [(r["usd"], r["scores"][task]) for r in points if task in r["scores"]]
        metric = main_metric(mine[0][1])
        ax.plot(
            [u for u, _ in mine], [m.get(metric, np.nan) for _, m in mine], "o-", label=f"{task} {metric}"
        )
    ax.set_xlabel("dollars spent")
    ax.set_ylabel("benchmark score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with open_atomic(path) as f:  # a full disk: DiskFull (exit 74), no half-written png
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return path


def plot_throughput(scalars: dict[str, Series], path: Path) -> Path | None:
    if "perf/tokens_per_sec" not in scalars or len(scalars["perf/tokens_per_sec"]) < 2:
        return None
    tps = scalars["perf/tokens_per_sec"]
    hours = (tps.times - tps.times[0]) / 3600
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(hours, tps.values, lw=1)
    ax.set_xlabel("wall-clock hours since the first point (gaps are restarts)")
    ax.set_ylabel("training tokens/s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with open_atomic(path) as f:  # a full disk: DiskFull (exit 74), no half-written png
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return path


def plot_cost_breakdown(ledger: dict | None, path: Path) -> Path | None:
    if not ledger:
        return None
    seconds = [ledger["seconds"].get(b, 0.0) for b in BUCKETS]
    price, devices = ledger.get("price_per_hour"), ledger.get("devices", 1)
    values = [s * price * devices / 3600 for s in seconds] if price else [s / 3600 for s in seconds]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(list(BUCKETS), values, color=["C7", "C0", "C2", "C1", "C3"])
    ax.set_xlabel("dollars" if price else "hours")
    ax.set_title("where the time went")
    fig.tight_layout()
    with open_atomic(path) as f:  # a full disk: DiskFull (exit 74), no half-written png
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return path


def smooth(values: np.ndarray) -> np.ndarray:
    """Trailing mean over ~5% of the points: shows the trend without the lag of a long EMA."""
    window = max(1, len(values) // 20)
    cumsum = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (cumsum[1:] - cumsum[np.arange(len(values)) + 1 - counts]) / counts


def stopping_section(stop: dict | None, sched: dict | None) -> str:
    """Why the run stopped (stop.json); the heading of the loss forecast that `forecast_section` renders."""
    if stop is None and not sched:
        return ""
    lines = ["", "## Stopping and forecast", ""]
    if stop is not None:
        status = "stopped early" if stop.get("stopped") else "early stop decided (cooling down)"
        lines.append(f"**{status}** at step {stop.get('step', stop['decided_at_step']):,}: {stop['reason']}.")
        if stop.get("cooldown"):
            start, length = stop["cooldown"]
            lines.append(
                f"The stop was decided at step {start:,}; the LR then cooled down linearly to its floor over "
                f"{length:,} steps before training ended."
            )
        if stop.get("usd") is not None:
            lines.append(f"Spent at the stop: {fmt_money(stop['usd'])} for {stop.get('tokens', 0):,} tokens.")
        lines.append("")
    return "\n".join(lines)


def failures_section(evals: list[dict], failures: list[dict]) -> str:
    """Optional work that failed while the run went on: a benchmark's `errors` at a milestone (evals.jsonl),
    milestone samples or benchmarks that failed whole (failures.jsonl)."""
    rows = [
        (r["step"], f"benchmark {task}", why) for r in evals for task, why in (r.get("errors") or {}).items()
    ]
    rows += [(f["step"], f"{f['what']} (rank {f['rank']})", f["error"]) for f in failures]
    if not rows:
        return ""
    lines = [
        "",
        "## What failed (the run went on without it)",
        "",
        "| step | what | error |",
        "|---|---|---|",
    ]
    for step, what, why in sorted(rows, key=lambda row: row[0]):
        lines.append(f"| {step:,} | {what} | {str(why).replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def benchmarks_section(evals: list[dict], last_eval: dict | None) -> str:
    """Benchmark scores at milestones (evals.jsonl) and the last `lm eval` (eval.json)."""
    if not evals and last_eval is None:
        return ""
    lines = ["", "## Benchmarks", ""]
    if evals:
        columns = list(
            dict.fromkeys(
                (t, main_metric(m)) for r in evals for t, m in r["scores"].items() if not is_core(t)
            )
        )
        cores = list(dict.fromkeys(core_name(r["core"]) for r in evals if r.get("core")))
        head = ["step", "phase", "$", *cores, *(f"{t} {m}" for t, m in columns), "mean", "seconds"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in evals:
            core = r.get("core") or {}
            cells = [f"{core['value']:.4f}" if core and core_name(core) == name else "" for name in cores]
            cells += [f"{r['scores'].get(t, {}).get(m, float('nan')):.3f}" for t, m in columns]
            mean = mean_score(r)
            lines.append(
                f"| {r['step']:,} | {r.get('phase') or ''} | {fmt_money(r.get('usd'))} | {' | '.join(cells)} | "
                f"{'' if mean is None else f'{mean:.3f}'} | {r['seconds']:.1f} |"
            )
        limit = evals[-1].get("limit")
        lines += [
            "",
            f"At milestones (`evals=`), {f'{limit} examples' if limit else 'every example'} per task"
            + (" (CORE where scored, else the mean accuracy, is the `mean` column)." if cores else "."),
            "",
        ]
        last_core = next((r["core"] for r in reversed(evals) if r.get("core")), None)
        if last_core:
            lines += [f"CORE at step {evals[-1]['step']:,}:", "", core_markdown(last_core), ""]
    if last_eval is not None:
        where = last_eval.get("checkpoint") or last_eval.get("model")
        lines += [f"`lm eval` of {where}:", ""]
        if last_eval.get("core"):
            lines += [core_markdown(last_eval["core"]), ""]
        scores = {t: m for t, m in last_eval["scores"].items() if not is_core(t)}
        lines += [evals_markdown(scores), ""] if scores else []
    return "\n".join(lines)


ENDINGS = (
    ("cooldown_now", "cool down now"),
    ("plan_end", "continue to the plan's end"),
    ("twice_the_steps", "twice the steps so far"),
    ("chinchilla", "the Chinchilla token count (20 x parameters)"),
)


def law_sentence(law: dict) -> str:
    """The forecast's law, its fit and the prior it started from (forecast.json's `law`)."""
    source = "fitted" if law["c_source"] == "fitted" else "from the prior: the LR had not fallen yet"
    fit = f"{law['n_points']} points, rms {law['rms']:.4f}"
    if not law.get("prior"):  # the schedule law without a calibrated prior (and records written before one)
        return (
            f"L = {law['L0']:.3f} + {law['A']:.4g} x S1^-{law['alpha']:.3f} - {law['C']:.3g} x S2 (the loss law "
            f"of Tissue et al. 2024, lm.numbers.loss_law: S1 the summed LR, S2 the annealing area; C {source}; "
            f"{fit}; no calibrated prior)."
        )
    name = {"schedule": "Tissue et al. 2024", "multi_power": "the multi-power law of Luo et al. 2025"}
    prior = law["prior"]
    return (
        f"{name.get(law['model'], law['model'])} (lm.numbers.loss_prior), alpha {law['alpha']:.3f}, the drop "
        f"{source}; {fit}; shape prior: {prior['source']}"
        + (f"; {law['choice']}" if law.get("choice") else "")
        + "."
    )


def forecast_section(sched: dict | None, measured: float | None, at_stop: bool) -> str:
    """The loss forecast, the schedule-aware law of lm.numbers.loss_law (from stop.json when the stopper
    decided, else forecast.json's latest): the run's endings with their 90% intervals and dollars, against
    the run's last measured validation loss. Records written before an ending existed lack its key."""
    if not sched:
        return ""
    lines = [
        "",
        f"Schedule-aware forecast{' when the stop was decided' if at_stop else ''}, at step {sched['step']:,}: "
        + law_sentence(sched["law"]),
        "",
        "| ending | final loss (90% interval) | dollars |",
        "|---|---|---|",
    ]
    for key, name in ENDINGS:
        o = sched.get(key)
        if o:
            at = sched["step"] + o["steps"] if key == "cooldown_now" else o["steps"]
            lines.append(
                f"| {name} (step {at:,}) | {o['loss']:.3f} ({o['low']:.3f}-{o['high']:.3f}) | {fmt_money(o['usd'])} |"
            )
    if "usd_per_loss_point_now" in sched:
        lines.append(
            f"| a loss point now costs (training on before the cooldown) | | "
            f"{fmt_money(sched['usd_per_loss_point_now'])} |"
        )
    lines.append(
        f"| the next loss point costs (a plan 10% longer) | | {fmt_money(sched['usd_per_loss_point_next'])} |"
    )
    if measured is not None:
        lines += ["", f"Measured: the last validation loss was {measured:.3f}."]
    lines.append("")
    return "\n".join(lines)


def reference_section(ref: dict | None) -> str:
    """The reference-curve forecast (lm.numbers.reference): which run it read, the offset, the interval's source."""
    if not ref:
        return ""
    unchecked = ref.get("unchecked_keys") or []
    return (
        f"\nReference forecast at {ref['fraction']:.0%} of the plan: final loss {ref['final_loss']:.3f} "
        f"({ref['low']:.3f}-{ref['high']:.3f}), read off `{ref['reference']}` moved by {ref['offset']:+.3f}"
        f"{' (the ratio map)' if ref.get('map') == 'ratio' else ''}; "
        f"the interval from {ref['interval_from']}."
        + (
            f" Not checked against the run (the reference does not record them): {', '.join(unchecked)}."
            if unchecked
            else ""
        )
        + "\n"
    )


def core_forecast_section(core: dict | None) -> str:
    """The CORE forecast (forecast.json's `core`, lm.numbers.core_map): the final CORE at the loss forecast's
    endings, through the loss-to-CORE map, and whether that map is calibrated."""
    if not core:
        return ""
    lines = ["", f"CORE forecast ({core['label']}; {core['milestones']} CORE milestones):", ""]
    lines += ["| ending | loss | CORE (90% interval) |", "|---|---|---|"]
    for key, name in ENDINGS:
        o = core.get(key)
        if o:
            lines.append(f"| {name} | {o['loss']:.3f} | {o['core']:.3f} ({o['low']:.3f}-{o['high']:.3f}) |")
    if core.get("why"):
        lines += ["", f"Uncalibrated: {core['why']}."]
    return "\n".join(lines) + "\n"


def samples_section(records: list[dict]) -> str:
    """A prompt x milestone table per prompt, so progress reads side by side."""
    if not records:
        return ""
    lines = ["", "## Samples at milestones", ""]
    prompts = list(dict.fromkeys(r["prompt"] for r in records))
    for prompt in prompts:
        mine = [r for r in records if r["prompt"] == prompt]
        lines += [f"**{cell(prompt)}**", "", "| step | phase | greedy | sampled |", "|---|---|---|---|"]
        for step in sorted({r["step"] for r in mine}):
            by_mode = {r["mode"]: r for r in mine if r["step"] == step}
            any_r = next(iter(by_mode.values()))
            texts = [cell(by_mode[m]["text"]) if m in by_mode else "" for m in ("greedy", "temperature")]
            lines.append(f"| {step:,} | {any_r.get('phase') or ''} | {texts[0]} | {texts[1]} |")
        lines.append("")
    return "\n".join(lines)
