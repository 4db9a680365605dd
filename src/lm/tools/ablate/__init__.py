"""`lm ablate SPEC.yaml`: a baseline and its variants over several seeds at equal tokens, each arm at its own
best learning rate, across a ladder of shapes, and whether each paid.

The spec's keys are in `lm.tools.ablate.spec`. Every run is a real `python train.py` in
`<out>/runs/[<shape>/]<arm>[-<lr key><value>...][-f<fraction>]-s<seed>`, so a killed ablation continues where
it stopped: finished runs are kept, interrupted ones resume from their checkpoint, and an arm added to the spec
later reuses the others' runs. The stages, per shape:

1. with `lr`, the LR search: the baseline's grid on the search seeds, extended one grid step past an optimum on
   the edge until it is bracketed (or `max_extensions` are spent); then every variant's grid, an arm tuned on
   another key (Muon's `optim.muon_lr`) training its AdamW groups at the baseline's best `optim.lr`;
2. every arm at its best value over all seeds (the search seeds' runs are reused), and its `fractions`.

Per arm and shape (`ablation.md`, `.csv`, `.json`, `ablation.png`, `lr.png`, `ladder.png`):
- final validation loss (the evaluation at the last step, the end of the decay): mean and 95% t interval;
- the difference to the baseline, paired by seed (a seed whose final is not finite in either arm leaves the
  pair and is listed), its p value and Holm's adjustment across every comparison of the spec, all shapes
  together; the verdict (wins / loses / within noise) from the adjusted p, or `no seed spread` (no p) when the
  seeds give one difference or an arm's seeds all left the same curve; what the LR grid's spacing may cost,
  flagged where it exceeds the difference;
- tokens for the same loss, over the baseline's: with `fractions: {baseline: [...]}` the speed-up of Wen et
  al. 2025 (the baseline tokens whose final loss equals the variant's, interpolated in log tokens between the
  baseline's complete runs, its interval a paired t test inverted over seeds, whose coverage
  tests/numbers/test_coverage.py measures; outside their range a bound); else from the arm's own
  shorter runs, else off its curve (upper bounds only). A seed known only as a bound is never an observation
  in a t interval: bounds give a one-sided bound of the mean;
- FLOPs per token (the cost model's formula plus Muon's Newton-Schulz FLOPs per step over the tokens of a
  step) and seconds per step measured with every arm's steps interleaved in one process, as ratios;
- measured dollars to the baseline's final loss (tokens x the interleaved seconds-per-step ratio) and modelled
  ones (tokens x FLOPs ratios, equal MFU: never a saving on their own), and modelled dollars per loss point;
- with `shapes`, the paired Δ and (where every seed of a rung is measured) the tokens ratio fitted against
  non-embedding parameters (a line in log N, a bootstrap over each shape's seeds) and carried to
  `extrapolate_to` (plan_1b) only when it lies within 3x of the largest rung, else "not stated"; beside it the fits without each rung and on the
  largest rungs, and "grows / holds / shrinks with scale" only where every fit agrees.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lm.base.exits import EXIT_PREEMPTED, Refused, one_line
from lm.tools.ablate.analysis import (
    ArmRow,
    RunResult,
    best_value,
    judge,
    lr_grid_cost,
    lr_scores,
    read_run,
    summarize,
    tokens_to_reach,
)
from lm.tools.ablate.ladder import Trend, trends
from lm.tools.ablate.report import ShapeReport, write_report
from lm.tools.ablate.runner import Runner, cached_step_times, finished, prepare_data
from lm.tools.ablate.spec import (
    BASELINE,
    Job,
    Shape,
    Spec,
    arm_lr_keys,
    arm_shape,
    extend,
    fraction_steps,
    ladder_overrides,
    load_spec,
    make_job,
    plan_jobs,
)

__all__ = [
    "BASELINE", "ArmRow", "Campaign", "Job", "RunResult", "Shape", "Spec", "ablate", "fraction_steps", "load_spec",
    "plan_jobs", "summarize", "tokens_to_reach",
]  # fmt: skip

log = logging.getLogger(__name__)

SUMMARY_EVERY_S = 60.0


class Campaign:
    """What each shape needs next, decided from the runs on disk: the LR search's stages, then the finals."""

    def __init__(
        self, spec: Spec, out: Path, ladder: dict[str, list[str]], shapes: dict[str, dict[str, Shape]]
    ):
        self.spec, self.out, self.ladder, self.shapes = spec, out, ladder, shapes
        self.read = self.read_once
        """How a run is read back (a test gives constructed results)."""
        self.ended: dict[str, RunResult] = {}
        """Runs that finished or diverged, read once: a campaign asks for them at every job's end, and rereading
        every TensorBoard file each time cost minutes per decision once a ladder had ~80 runs."""

    def read_once(self, job: Job, shape: Shape, out: Path | None = None) -> RunResult:
        """`read_run`, remembered once the run has ended (its events and exit file no longer change)."""
        if job.key in self.ended:
            return self.ended[job.key]
        result = read_run(job, shape, out)
        if result.status == "diverged" or (result.status == "done" and result.final is not None):
            self.ended[job.key] = result
        return result

    def job(self, shape: str, arm: str, seed: int, lr: dict[str, float]) -> Job:
        return make_job(self.spec, self.out, shape, self.ladder[shape], arm, seed, lr, 1.0,
                        self.shapes[shape][arm].steps)  # fmt: skip

    def search(
        self, shape: str, arm: str, best: dict[str, dict[str, float]]
    ) -> tuple[list[Job], ShapeSearch]:
        """The arm's search jobs so far and its state: its grid grows past an edge optimum, one point a time."""
        key, values = self.spec.lr.grid_for(arm)
        inherited = arm_lr_keys(self.spec, arm, best)
        initial = len(values)
        while True:
            jobs = [
                self.job(shape, arm, s, {**inherited, key: v}) for v in values for s in self.spec.search_seeds
            ]
            results = [self.read(j, self.shapes[shape][arm], self.out) for j in jobs]
            scores = lr_scores(results, key)
            chosen = best_value(scores)
            if chosen is None:
                return jobs, ShapeSearch(key, scores, None, False)
            more = extend(values, chosen, len(values) - initial, self.spec.lr.max_extensions)
            if more is None:
                inside = not (chosen == min(values) or chosen == max(values))
                return jobs, ShapeSearch(key, scores, {**inherited, key: chosen}, inside)
            values = [*values, more]

    def tuned(self, shape: str) -> tuple[list[Job], dict[str, ShapeSearch]]:
        """Every search job of the shape that exists so far, and each arm's search state."""
        jobs, states, best = [], {}, {}
        if not self.spec.lr:
            return [], {}
        order = [BASELINE] + [a for a in self.spec.arms if a != BASELINE]
        for arm in order:
            if arm != BASELINE and BASELINE not in best and arm_needs_baseline(self.spec, arm):
                break
            arm_jobs, state = self.search(shape, arm, best)
            jobs += arm_jobs
            states[arm] = state
            if state.best is not None:
                best[arm] = state.best
        return jobs, states

    def finals(self, shape: str, states: dict[str, ShapeSearch]) -> list[Job]:
        """The final runs of every arm whose LR is settled (all arms without an LR search)."""
        if self.spec.lr:
            lr = {arm: s.best for arm, s in states.items() if s.best is not None}
            arms = [a for a in self.spec.arms if a in lr]
        else:
            lr, arms = {}, list(self.spec.arms)
        jobs = plan_jobs(self.spec, self.out, self.shapes[shape], lr, shape, self.ladder[shape])
        return [j for j in jobs if j.arm in arms]

    def pending(self) -> list[Job]:
        """The unfinished jobs every shape can run now (search seeds first, then the remaining seeds)."""
        todo = []
        for shape in self.shapes:
            search, states = self.tuned(shape)
            todo += [j for j in search if not finished(j, self.out)]
            settled = not self.spec.lr or (
                len(states) == len(self.spec.arms)
                and all(s.best is not None or s.failed for s in states.values())
            )
            if settled:
                todo += [j for j in self.finals(shape, states) if not finished(j, self.out)]
        unique = {j.key: j for j in todo}
        return list(unique.values())

    def known(self) -> list[Job]:
        """Every job decided so far: the search runs and the final runs of settled arms."""
        jobs = []
        for shape in self.shapes:
            search, states = self.tuned(shape)
            jobs += search + self.finals(shape, states)
        return list({j.key: j for j in jobs}.values())

    def reports(self, times: dict[str, dict[str, float]] | None = None) -> list[ShapeReport]:
        reports = []
        for shape, arm_shapes in self.shapes.items():
            _, states = self.tuned(shape)
            results = [self.read_once(j, arm_shapes[j.arm], self.out) for j in self.finals(shape, states)]
            report = ShapeReport(shape, arm_shapes, results)
            report.search = {arm: s.scores for arm, s in states.items()}
            report.keys = {arm: s.key for arm, s in states.items()}
            report.best = {arm: s.best for arm, s in states.items() if s.best is not None}
            report.bracketed = {arm: s.bracketed for arm, s in states.items()}
            costs = {arm: lr_grid_cost(s.scores, (s.best or {}).get(s.key)) for arm, s in states.items()}
            if any(r.arm == BASELINE and r.final is not None for r in results):
                shape_times = (times or {}).get(shape)
                report.rows = summarize(
                    self.spec, results, arm_shapes, shape_times, report.best, shape, costs
                )
            reports.append(report)
        judge([r for rep in reports for r in rep.rows])  # one family: every comparison of the spec
        return reports


@dataclass
class ShapeSearch:
    """One arm's LR search at one shape."""

    key: str
    """The key the arm tunes."""
    scores: dict[float, float | None]
    """Mean final loss over the search seeds at each value tried (None while a run is unfinished)."""
    best: dict[str, float] | None
    """The values the arm trains at (its best, with what it inherits from the baseline); None until settled."""
    bracketed: bool

    @property
    def failed(self) -> bool:
        """Every value scored and none finite: the arm diverged at every LR tried."""
        return self.best is None and bool(self.scores) and all(s is not None for s in self.scores.values())


def arm_needs_baseline(spec: Spec, arm: str) -> bool:
    """An arm that tunes a key other than the baseline's trains the baseline's key at its best value."""
    return spec.lr.grid_for(arm)[0] != spec.lr.grid_for(BASELINE)[0]


def target_flops_ratios(spec: Spec) -> tuple[int | None, dict[str, float | None]]:
    """Non-embedding parameters of `extrapolate_to` and each arm's FLOPs/token ratio there (None where the
    arm's overrides do not compose with it)."""
    try:
        base = arm_shape([*spec.extrapolate_to, *spec.baseline])
    except Exception as e:  # the target is a label for the trend; the ablation stands without it
        log.warning(
            "lm ablate: extrapolate_to %s does not compose (%s); no extrapolation", spec.extrapolate_to, e
        )
        return None, {}
    ratios: dict[str, float | None] = {}
    for arm, overrides in spec.arms.items():
        try:
            ratios[arm] = arm_shape([*spec.extrapolate_to, *overrides]).flops_per_token / base.flops_per_token
        except Exception:
            ratios[arm] = None
    return base.params, ratios


def write_summary(
    campaign: Campaign, times: dict[str, dict[str, float]] | None = None
) -> tuple[Path, list[ShapeReport]]:
    spec = campaign.spec
    reports = campaign.reports(times)
    found: list[Trend] = []
    if len(spec.shapes) >= 2:
        params, ratios = target_flops_ratios(spec)
        if params:
            found = trends({r.name: r.rows for r in reports}, list(spec.arms), params, ratios)
    return write_report(campaign.out, spec, reports, found), reports


def measure_step_times(campaign: Campaign, threads: int | None) -> dict[str, dict[str, float]]:
    """Each shape's arms' step times, kept in `<out>/[<shape>/]step_times.json`."""
    spec, times = campaign.spec, {}
    for shape, extra in campaign.ladder.items():
        arms = {arm: [*spec.base, *extra, *spec.arm_overrides(arm, shape)] for arm in spec.arms}
        times[shape] = cached_step_times(
            arms, campaign.out / "runs" / shape if shape else campaign.out, threads
        )
    return times


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
    ladder, shapes = {}, {}
    for shape in spec.shape_names:
        where = f"shape {shape}: " if shape else ""
        try:
            ladder[shape] = ladder_overrides(spec, shape)
        except Exception as e:
            raise Refused(f"{spec_path}: {where}the config is refused: {one_line(e)}") from e
        shapes[shape] = {}
        for arm in spec.arms:
            try:
                shapes[shape][arm] = arm_shape([*spec.base, *ladder[shape], *spec.arm_overrides(arm, shape)])
                for f in spec.fractions.get(arm, []):
                    fraction_steps(shapes[shape][arm], f)
            except (
                Exception
            ) as e:  # Hydra's and OmegaConf's errors too: a bad override is refused before any run
                raise Refused(f"{spec_path}: {where}{arm}'s config is refused: {one_line(e)}") from e
    campaign = Campaign(spec, out, ladder, shapes)
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, parallel, threads, timeout)
    last = [time.monotonic()]

    def on_end(
        job: Job,
    ) -> None:  # the summary as runs end, at most once a minute (it reads every run's events)
        if time.monotonic() - last[0] > SUMMARY_EVERY_S:
            write_summary(campaign)
            last[0] = time.monotonic()

    if not report_only:  # once, before parallel runs would each tokenize the same corpus; its key decides
        prepare_data(spec, out)  # which recorded results are reused (`runner.recorded`)
    todo = [] if report_only else campaign.pending()
    known = len(campaign.known())
    log.info("lm ablate: %d runs, %d to run (%d done)", known, len(todo), known - len(todo))
    if todo:
        runner.run(campaign.pending, on_end)
        write_summary(campaign)
    done = not runner.stopping and not runner.failed and not campaign.pending()
    times = measure_step_times(campaign, threads) if done else None
    md, _ = write_summary(campaign, times)
    print(md.read_text(), end="")
    print(f"wrote {md}, ablation.csv, ablation.json and the plots in {out}")
    if runner.stopping:
        print(f"lm ablate: stopped by a signal; rerun the same command to continue ({out})", file=sys.stderr)
        return EXIT_PREEMPTED
    if runner.failed:
        for name, why in runner.failed.items():
            print(f"lm ablate: run {name} failed: {why}", file=sys.stderr)
        return 1
    return 0
