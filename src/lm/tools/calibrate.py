"""`lm plan --calibrate`: fit the planner's law L(N, D) = E + A/N^alpha + B/D^beta to short runs of small
models on the user's own corpus and hardware, so the plan's losses are in that corpus's and tokenizer's units
instead of the published fits' ("uncalibrated").

Each calibration run is a real `lm.run.train` run (in this process, one after another) of one shape of a small
width/depth grid for one token count; its final validation loss is one point (N, D, L). The fit is the one
Hoffmann et al. 2022 used: a grid over (alpha, beta), and for each pair the non-negative E, A, B under a Huber
loss (lm.numbers.fit.robust_nnls, every pair of the grid solved as one batch), the pair of least loss kept. A handful
of points cannot pin five constants: below FREE_EXPONENTS_MIN points the exponents are fixed at the Besiroglu
et al. 2024 values and only E, A, B are fitted, and the law file says so.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lm.base.exits import Refused
from lm.config import DataConfig, compose, to_objects
from lm.data.manifest import prepared_folder
from lm.numbers import memory, run_plan
from lm.numbers.core_map import SIGNAL, Point, carries_signal, public_prior, run_points
from lm.numbers.core_map import calibrate as calibrate_core
from lm.numbers.fit import robust_nnls
from lm.numbers.loss_law import BESIROGLU, ChinchillaLaw, block_means
from lm.numbers.loss_prior import priors_from_curves, priors_record
from lm.numbers.lr_schedule import multipliers
from lm.run.train import main as train_main
from lm.store import rundir
from lm.store.atomic import write_atomic

MIN_POINTS = 4
"""Fewest points a fit accepts: three constants (E, A, B) and one residual to judge them by."""
FREE_EXPONENTS_MIN = 8
"""Points from which alpha and beta are fitted too; fewer fix them at the Besiroglu et al. 2024 values."""
HUBER_DELTA = 0.01
"""Residual (in loss units) beyond which a point counts linearly: one diverged run must not bend the law."""
EXPONENTS = np.round(np.arange(0.05, 1.0001, 0.01), 2)
"""The (alpha, beta) grid: published fits lie in 0.28-0.37; the grid is wide enough for other corpora."""
HEAD_DIM = 32
"""Attention head width of the calibration shapes (n_head = d_model / HEAD_DIM)."""
TRAIN_BLOCK = 5
"""Training losses averaged per point of the curves the forecast prior is fitted to (lm.numbers.loss_law
block_means): the runs validate once, so their logged training loss is the curve."""


@dataclass(frozen=True)
class CalibrationPoint:
    """One calibration run: its parameters, training tokens and final validation loss."""

    shape: str
    n: int
    d: int
    loss: float


@dataclass(frozen=True)
class Fit:
    """The fitted law, how well it fits, and what was held fixed."""

    law: ChinchillaLaw
    rmse: float
    fixed: str | None
    """Why the exponents were not fitted, or None when all five constants were."""


def check_counts(runs: int, sizes: int, tokens: int) -> None:
    """A clear error when so few runs, sizes or token counts cannot determine the law."""
    if runs < MIN_POINTS or sizes < 2 or tokens < 2:
        raise Refused(
            f"calibration needs at least {MIN_POINTS} runs spanning at least 2 model sizes and 2 token counts "
            f"(got {runs} run(s), {sizes} size(s), {tokens} token count(s)); give more --calibrate-shapes "
            "or --calibrate-steps"
        )


def check_points(points: list[CalibrationPoint]) -> None:
    """A clear error when the points cannot determine the law."""
    check_counts(len(points), len({p.n for p in points}), len({p.d for p in points}))
    bad = [p.shape for p in points if not math.isfinite(p.loss)]
    if bad:
        raise Refused(f"calibration runs {', '.join(bad)} ended without a finite validation loss")


def fit_law(points: list[CalibrationPoint], source: str) -> Fit:
    """The Chinchilla-form law that fits the points best (see the module docstring)."""
    check_points(points)
    n = np.array([p.n for p in points], dtype=float)
    d = np.array([p.d for p in points], dtype=float)
    y = np.array([p.loss for p in points])
    fixed = None
    if len(points) < FREE_EXPONENTS_MIN:
        pairs = np.array([[BESIROGLU.alpha, BESIROGLU.beta]])
        fixed = (
            f"alpha and beta fixed at Besiroglu et al. 2024's ({BESIROGLU.alpha}, {BESIROGLU.beta}): "
            f"{len(points)} runs are too few to fit them (need {FREE_EXPONENTS_MIN})"
        )
    else:
        pairs = np.array(list(itertools.product(EXPONENTS, EXPONENTS)))
    x = np.stack([np.ones((len(pairs), len(points))), n[None] ** -pairs[:, :1], d[None] ** -pairs[:, 1:]], 2)
    coef, huber = robust_nnls(x, y, HUBER_DELTA)
    i = int(np.argmin(huber))
    law = ChinchillaLaw(*map(float, coef[i]), float(pairs[i, 0]), float(pairs[i, 1]), source)
    rmse = math.sqrt(sum((law.loss(p.n, p.d) - p.loss) ** 2 for p in points) / len(points))
    return Fit(law, rmse, fixed)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`2x64,4x128` -> [(n_layer, d_model), ...]; a clear error for anything else."""
    try:
        shapes = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or s[1] % HEAD_DIM for s in shapes):
        raise Refused(
            f"--calibrate-shapes {text!r}: give n_layer x d_model pairs, d_model a multiple of {HEAD_DIM}, "
            "e.g. 2x64,3x96,4x128"
        )
    return shapes


def calibration_run(
    overrides: list[str], root: Path, layers: int, width: int, steps: int
) -> tuple[CalibrationPoint, dict, tuple | None]:
    """Train one shape for `steps` steps (validated once, at the end); its point, cost ledger and loss curve."""
    name = f"cal_{layers}x{width}_s{steps}"
    cfg = compose(
        [
            *overrides,
            f"run.root={root}",
            f"run.name={name}",
            "run.resume=false",
            f"model.n_layer={layers}",
            f"model.d_model={width}",
            f"model.n_head={width // HEAD_DIM}",
            "model.n_kv_head=null",
            f"trainer.max_steps={steps}",
            f"trainer.val_every_steps={steps}",
            "optim.total_steps=null",
            f"optim.warmup_steps={max(1, steps // 10)}",
            "sampling=off",
        ]
    )
    objects = to_objects(cfg)
    model = objects.model
    tokens_per_step = run_plan.resolve(
        objects.data, objects.trainer, objects.optim, world=1
    ).tokens_per_device_step
    loss = train_main(cfg)
    point = CalibrationPoint(
        name, memory.parameter_count(model)[0], steps * tokens_per_step, float(loss or math.nan)
    )
    return point, rundir.read_ledger(root / name) or {}, run_curve(root / name, objects.optim, steps)


def run_curve(run_dir: Path, optim, steps: int) -> tuple | None:
    """(steps, block-mean training losses, LR multipliers of the run) for the forecast prior; None when the
    run logged no training loss."""
    logged = rundir.read_scalars(run_dir).get("train/loss")
    points = None if logged is None else train_points(logged.steps, logged.values, optim.warmup_steps)
    return None if points is None else (*points, multipliers(optim, steps))


def train_points(steps: np.ndarray, losses: np.ndarray, warmup: int) -> tuple | None:
    """Block means of the logged training losses after the warm-up, at the steps done (a loss logged at step s
    saw s + 1 updates); None when too few. The warm-up transient follows no law, and a block mean across its
    steep start would be no point of the curve."""
    late = np.asarray(steps) >= 2 * warmup
    if late.sum() < TRAIN_BLOCK:
        return None
    return block_means(np.asarray(steps)[late] + 1, np.asarray(losses)[late], TRAIN_BLOCK)


def calibrate(
    overrides: list[str], root: Path, shapes: list[tuple[int, int]], steps: list[int], data: DataConfig
) -> dict:
    """Train every shape x step count on `data`, fit the law and return the calibration record."""
    check_counts(len(shapes) * len(steps), len(set(shapes)), len(set(steps)))  # before any training
    started = time.monotonic()
    points, curves, usd = [], [], 0.0
    for (layers, width), n_steps in itertools.product(shapes, steps):
        point, ledger, curve = calibration_run(overrides, root, layers, width, n_steps)
        points.append(point)
        curves += [curve] if curve is not None else []
        usd += ledger.get("usd") or 0.0
    fit = fit_law(points, f"calibrated on {corpus_label(data)}")  # now prepared: named by its folder
    priors = priors_from_curves(
        curves, f"training-loss curves of the calibration runs on {corpus_label(data)}"
    )
    return {
        # The loss forecast's shape prior (early_stopping.forecast_prior); empty when no run's LR decayed.
        "forecast_prior": priors_record(priors),
        "law": asdict(fit.law),
        "rmse": fit.rmse,
        "fixed": fit.fixed,
        "points": [asdict(p) for p in points],
        "cost": {"seconds": time.monotonic() - started, "usd": usd},
        "overrides": overrides,
    }


def write_calibration(path: Path, record: dict) -> None:
    write_atomic(path, json.dumps(record, indent=2) + "\n")


def load_law(path: Path) -> tuple[ChinchillaLaw, float]:
    """The law of a calibration file and its fit's RMSE (the plan's interval); a clear error when unreadable."""
    try:
        record = json.loads(Path(path).read_text())
        return ChinchillaLaw(**record["law"]), float(record["rmse"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Refused(
            f"--law {path}: not a calibration file ({e}); write one with `lm plan --calibrate`"
        ) from e


def describe(record: dict) -> str:
    """What the calibration found and cost, for the terminal."""
    law, cost = record["law"], record["cost"]
    lines = [
        f"{p['shape']:<16} N={p['n']:>10,} D={p['d']:>12,} val loss {p['loss']:.4f}" for p in record["points"]
    ]
    lines.append(
        f"law ({law['source']}): L = {law['E']:.3f} + {law['A']:.4g}/N^{law['alpha']:.2f} + "
        f"{law['B']:.4g}/D^{law['beta']:.2f}, fit RMSE {record['rmse']:.4f}"
    )
    if record["fixed"]:
        lines.append(record["fixed"])
    lines.append(f"calibration cost: {cost['seconds']:.0f} s wall, ${cost['usd']:.4f} at the run's price")
    return "\n".join(lines)


def corpus_label(data: DataConfig) -> str:
    """How the law file names the corpus: its prepared folder, else its source."""
    folder = prepared_folder(data)
    return folder.name if folder is not None else data.source


# --- the loss-to-CORE map, calibrated on the user's runs (`lm core-map`) --------------------------------


def core_points_of(run_dir: Path, version: str) -> tuple[list[Point], str | None]:
    """A finished run's (validation loss, CORE) points: its evals.jsonl CORE milestones, each at the
    validation of its step (TensorBoard's `val/loss`, logged at the index of the step's last batch)."""
    if not (run_dir / rundir.EVALS).is_file():
        raise Refused(f"{run_dir} has no {rundir.EVALS}: train it with evals=core (CORE at its end at least)")
    series = rundir.read_scalars(run_dir).get("val/loss")
    if series is None:
        raise Refused(f"{run_dir} logged no val/loss (TensorBoard under {run_dir / rundir.TB})")
    validations = [(int(s) + 1, float(v)) for s, v in zip(series.steps, series.values)]
    return run_points(rundir.read_evals(run_dir), validations, version, group=run_dir.name)


def core_map_record(run_dirs: list[Path], version: str) -> dict:
    """The public prior's shape with its shift calibrated on the runs' CORE points (`core_map.json`): the map,
    every point with whether it carried signal, and the CORE figure's name. Points of different CORE names
    (coverage, convention) are refused, as are runs without any point."""
    points, names = [], set()
    for run_dir in run_dirs:
        mine, name = core_points_of(run_dir, version)
        if not mine:
            raise Refused(f"{run_dir}: no CORE milestone under {version} at a validation step; train it with "
                          "evals=core, a milestone at a validation step (its end is both)")  # fmt: skip
        points += mine
        names.add(name)
    if len(names) > 1:
        raise Refused(f"the runs' CORE figures differ ({', '.join(sorted(names))}): score them the same way")
    source = f"{len(run_dirs)} runs: {', '.join(d.name for d in run_dirs)}"
    cmap = calibrate_core(public_prior(version), points, source)
    return {
        "map": cmap.record(),
        "name": names.pop(),
        "points": [asdict(p) | {"signal": carries_signal(p)} for p in points],
    }


def describe_core_map(record: dict) -> str:
    m = record["map"]
    used = sum(p["signal"] for p in record["points"])
    return (
        f"{record['name']}: shift {m['shift']:+.3f} +- {m['shift_sd']:.3f} nats from {used} of "
        f"{len(record['points'])} points (those at CORE >= {SIGNAL:g}, clear of chance); shape from "
        f"{public_prior(m['version']).source}"
    )
