"""What an ablation runs: the spec (read and checked), each arm's shape, and the jobs of each stage.

A spec is YAML; every key but `variants` is optional:

    name: levers-tiny
    base: [model=tiny, trainer.max_steps=300, trainer.val_every_steps=30]   # any overrides, +experiment=...
    seeds: 5                     # or a list: [0, 1, 2]; `run.seed` = init and data order
    baseline: []                 # overrides of the baseline alone
    variants:
      qk_norm: [model.qk_norm=true]
      modern: [model.qk_norm=true, optim=muon]
      seq_warmup:                # overrides that differ by shape: `all` for every shape, then each shape's
        all: [data.seq_len_warmup_start=0.25]
        s64: [data.seq_len_warmup_steps=40]
        s128: [data.seq_len_warmup_steps=160]
    fractions:                   # shorter runs of an arm (each with its own LR decay), at its best LR
      baseline: [0.5, 0.6, 0.8]  # the baseline at several lengths: each variant's speed-up (Wen et al. 2025)
      qk_norm: [0.6, 0.8]
    lr:                          # each arm at its own best LR (a 1-D grid per arm, log-spaced)
      grid: {optim.lr: [1e-3, 3e-3, 1e-2]}       # every arm's grid unless `arms` names its own
      arms: {modern: {optim.muon_lr: [3e-3, 1e-2, 3e-2]}}   # tunes Muon alone: optim.lr stays the baseline's best
      seeds: 2                   # the search runs the first 2 seeds; the best LR then runs every seed
      max_extensions: 3          # an optimum on the grid's edge adds a point beyond it, at most this often
    shapes:                      # a ladder: every arm at every shape, matched tokens per parameter
      s64: [model.n_layer=2, model.d_model=64]
      s128: [model.n_layer=4, model.d_model=128]
    tokens_per_param: 2.0        # with shapes: steps = this x non-embedding parameters / tokens per step
    validations: 10              # with shapes: validations per run (the last at the last step)
    warmup_fraction: 0.05        # with shapes: warm-up steps as a share of each shape's steps
    gpu: h100_sxm                # the catalog entry the modelled dollars use
    mfu: 0.45
    extrapolate_to: [+experiment=plan_1b]   # with shapes: the config the gain's trend is carried to

An arm tuned on a key other than the baseline's (Muon's `optim.muon_lr`) takes the baseline's best value of
the baseline's key (`optim.lr`, which the AdamW groups of embedding, head and norms use), so the arm changes one
thing: the optimizer of the matrices.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lm.base.exits import Refused
from lm.numbers.batch_ramp import BatchRamp
from lm.numbers.cost import ASSUMED_MFU

BASELINE = "baseline"
SINGLE = ""
"""The shape name of an ablation without `shapes` (its runs live directly under `<out>/runs`)."""
NAME = re.compile(r"^[A-Za-z0-9_.+]+$")
SPEC_KEYS = {
    "name", "base", "seeds", "baseline", "variants", "fractions", "gpu", "mfu", "pricing", "lr", "shapes",
    "tokens_per_param", "validations", "warmup_fraction", "extrapolate_to",
}  # fmt: skip
LR_KEYS = {"grid", "arms", "seeds", "max_extensions"}


@dataclass
class LRSearch:
    """Each arm's learning-rate grid: searched on the first `seeds` seeds, extended past an edge optimum."""

    grid: dict[str, list[float]] = field(default_factory=dict)
    arms: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    seeds: int = 2
    max_extensions: int = 3

    def grid_for(self, arm: str) -> tuple[str, list[float]]:
        """The key an arm tunes and its initial values (sorted)."""
        key, values = next(iter((self.arms.get(arm) or self.grid).items()))
        return key, sorted(values)


@dataclass
class Spec:
    """What to compare: a base config, the variants' overrides, the seeds, the LR search, the ladder."""

    name: str
    variants: dict[str, list[str]]
    """Each variant's overrides at every shape."""
    base: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    baseline: list[str] = field(default_factory=list)
    fractions: dict[str, list[float]] = field(default_factory=dict)
    gpu: str = "h100_sxm"
    mfu: float = ASSUMED_MFU
    pricing: str = "on_demand"
    lr: LRSearch | None = None
    shapes: dict[str, list[str]] = field(default_factory=dict)
    tokens_per_param: float | None = None
    validations: int = 10
    warmup_fraction: float | None = None
    extrapolate_to: list[str] = field(default_factory=lambda: ["+experiment=plan_1b"])
    per_shape: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """A variant's further overrides at one shape ({variant: {shape: overrides}})."""

    @property
    def arms(self) -> dict[str, list[str]]:
        """The baseline and every variant, each with the overrides it has at every shape."""
        return {BASELINE: self.baseline, **self.variants}

    def arm_overrides(self, arm: str, shape: str = SINGLE) -> list[str]:
        """An arm's overrides at `shape`: those of every shape, then the shape's own."""
        return [*self.arms[arm], *self.per_shape.get(arm, {}).get(shape, [])]

    @property
    def shape_names(self) -> list[str]:
        return list(self.shapes) or [SINGLE]

    @property
    def search_seeds(self) -> list[int]:
        return self.seeds[: self.lr.seeds] if self.lr else []


def overrides_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise Refused(f"{where} must be a list of overrides like [model.qk_norm=true]; got {value!r}")


def load_spec(path: Path) -> Spec:
    """The spec at `path`, checked: a clear error names the key and what it should be."""
    if not path.is_file():
        raise FileNotFoundError(f"no ablation spec at {path}; write one (see `lm ablate --help`)")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(raw, dict):
        raise Refused(f"{path}: an ablation spec is a mapping with at least `variants`")
    unknown = set(raw) - SPEC_KEYS
    if unknown:
        raise Refused(f"{path}: unknown key(s) {sorted(unknown)}; a spec has {sorted(SPEC_KEYS)}")
    variants = raw.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise Refused(f"{path}: `variants` must map each variant's name to its overrides")
    shapes = raw.get("shapes") or {}
    if not isinstance(shapes, dict):
        raise Refused(f"{path}: `shapes` must map each shape's name to its overrides")
    by_shape = {str(k): v for k, v in variants.items() if isinstance(v, dict)}
    spec = Spec(
        name=str(raw.get("name") or path.stem),
        variants={
            str(k): overrides_list(v.get("all") if isinstance(v, dict) else v, f"variants.{k}")
            for k, v in variants.items()
        },
        base=overrides_list(raw.get("base"), "base"),
        seeds=seed_list(raw.get("seeds", 3)),
        baseline=overrides_list(raw.get("baseline"), "baseline"),
        fractions={str(k): [float(f) for f in v] for k, v in (raw.get("fractions") or {}).items()},
        gpu=str(raw.get("gpu", "h100_sxm")),
        mfu=float(raw.get("mfu", ASSUMED_MFU)),
        pricing=str(raw.get("pricing", "on_demand")),
        lr=lr_search(raw["lr"], path) if raw.get("lr") is not None else None,
        shapes={str(k): overrides_list(v, f"shapes.{k}") for k, v in shapes.items()},
        tokens_per_param=float(raw["tokens_per_param"]) if raw.get("tokens_per_param") is not None else None,
        validations=int(raw.get("validations", 10)),
        warmup_fraction=float(raw["warmup_fraction"]) if raw.get("warmup_fraction") is not None else None,
        extrapolate_to=overrides_list(raw.get("extrapolate_to", ["+experiment=plan_1b"]), "extrapolate_to"),
        per_shape={
            arm: {str(k): overrides_list(v, f"variants.{arm}.{k}") for k, v in own.items() if k != "all"}
            for arm, own in by_shape.items()
        },
    )
    check_spec(spec, path)
    return spec


def grid(value: Any, where: str) -> dict[str, list[float]]:
    """`{key: [values]}` with one key and at least two positive values."""
    ok = isinstance(value, dict) and len(value) == 1
    values = next(iter(value.values())) if ok else None
    if not ok or not isinstance(values, list) or len(values) < 2:
        raise Refused(f"{where} must be one key and its values, like {{optim.lr: [1e-3, 3e-3, 1e-2]}}")
    try:
        floats = [float(v) for v in values]
    except (TypeError, ValueError):
        raise Refused(f"{where}: values must be numbers; got {values!r}") from None
    if any(v <= 0 for v in floats) or len(set(floats)) != len(floats):
        raise Refused(f"{where}: values must be distinct and positive (a log-spaced grid); got {values!r}")
    return {str(next(iter(value))): floats}


def lr_search(raw: Any, path: Path) -> LRSearch:
    if not isinstance(raw, dict) or set(raw) - LR_KEYS:
        raise Refused(f"{path}: `lr` is a mapping with keys {sorted(LR_KEYS)}; got {raw!r}")
    search = LRSearch(
        grid=grid(raw["grid"], "lr.grid") if raw.get("grid") is not None else {},
        arms={str(a): grid(g, f"lr.arms.{a}") for a, g in (raw.get("arms") or {}).items()},
        seeds=int(raw.get("seeds", 2)),
        max_extensions=int(raw.get("max_extensions", 3)),
    )
    if search.seeds < 1 or search.max_extensions < 0:
        raise Refused(f"{path}: lr.seeds must be >= 1 and lr.max_extensions >= 0")
    return search


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
    raise Refused(f"seeds must be a count (3) or a list of distinct integers ([0, 1, 2]); got {value!r}")


def check_spec(spec: Spec, path: Path) -> None:
    for name in [*spec.arms, *spec.shapes]:
        if not NAME.match(name):
            raise Refused(f"{path}: name {name!r} may hold only letters, digits and _ . +")
    if BASELINE in spec.variants:
        raise Refused(f"{path}: `{BASELINE}` is the baseline's name; set its overrides with `baseline:`")
    for arm, own in spec.per_shape.items():
        for shape in own:
            if shape not in spec.shapes:
                raise Refused(
                    f"{path}: variants.{arm}.{shape} names no shape; a variant's mapping has `all` and the "
                    f"shapes {sorted(spec.shapes)}"
                )
    for name, fractions in spec.fractions.items():
        if name not in spec.arms:
            raise Refused(f"{path}: fractions.{name} names no variant; variants: {sorted(spec.arms)}")
        if not all(0 < f < 1 for f in fractions):
            raise Refused(f"{path}: fractions.{name} must lie strictly between 0 and 1; got {fractions}")
    if not 0 < spec.mfu <= 1:
        raise Refused(f"{path}: mfu must be in (0, 1]; got {spec.mfu}")
    if spec.lr:
        for arm in spec.lr.arms:
            if arm not in spec.arms:
                raise Refused(f"{path}: lr.arms.{arm} names no variant; variants: {sorted(spec.arms)}")
        if not spec.lr.grid and set(spec.arms) - set(spec.lr.arms):
            missing = sorted(set(spec.arms) - set(spec.lr.arms))
            raise Refused(f"{path}: lr has no `grid` and no grid for {missing}; give `lr.grid`")
        if spec.lr.seeds > len(spec.seeds):
            raise Refused(f"{path}: lr.seeds={spec.lr.seeds} is more than the {len(spec.seeds)} seeds")
    if spec.shapes and (spec.tokens_per_param is None or spec.tokens_per_param <= 0):
        raise Refused(f"{path}: a ladder (`shapes`) needs tokens_per_param > 0, so every shape trains alike")
    if spec.tokens_per_param is not None and not spec.shapes:
        raise Refused(f"{path}: tokens_per_param sets each ladder shape's steps; it needs `shapes`")
    if spec.validations < 2:
        raise Refused(f"{path}: validations must be at least 2; got {spec.validations}")


# -- shapes -------------------------------------------------------------------------------------------------


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
    params: int = 0
    """Non-embedding parameters: the ladder's size axis."""
    decay_start: int | None = None
    """The step the LR starts to fall at (wsd: the last `optim.decay_fraction`; cosine: the warm-up's end;
    None: constant): a loss read off the curve after it is partly decayed."""

    def tokens_through(self, steps: int) -> int:
        """Tokens the arm's first `steps` optimizer steps train."""
        return self.ramp.tokens_through(steps) if self.ramp else steps * self.tokens_per_step


def compose_objects(overrides: list[str]):
    from lm.config import compose, to_objects

    return to_objects(compose(overrides))


def arm_shape(overrides: list[str]) -> Shape:
    """Compose an arm's config (refusing a bad override before any run starts) and read its numbers."""
    from lm.engine import optim
    from lm.numbers import cost, run_plan

    cfg = compose_objects(overrides)
    plan = run_plan.resolve(cfg.data, cfg.trainer, cfg.optim, world=1)
    steps, every = cfg.trainer.max_steps, cfg.trainer.val_every_steps
    if cfg.optim.total_steps not in (None, steps):
        raise Refused(
            f"optim.total_steps={cfg.optim.total_steps} differs from trainer.max_steps={steps}: an ablation "
            "compares runs at the end of their LR decay; drop optim.total_steps from the base"
        )
    if steps % every:
        raise Refused(
            f"trainer.max_steps={steps} is not a multiple of trainer.val_every_steps={every}: the final loss "
            "must be evaluated at the last step; pick values that divide"
        )
    # Muon's orthogonalisation is a cost per step: per token it is that over the tokens of a full step.
    optimizer = optim.muon_flops_per_step(cfg.model, cfg.optim) / plan.tokens_per_step
    flops = cost.flops_per_token(cfg.model, cfg.data.seq_len) + optimizer
    params = cost.non_embedding_params(cfg.model)
    o = cfg.optim
    decay = {"wsd": steps - int(o.decay_fraction * steps), "cosine": o.warmup_steps}.get(o.schedule)
    return Shape(steps, every, plan.tokens_per_step, flops, cfg.data.vocab_size, plan.ramp, params, decay)


def ladder_overrides(spec: Spec, shape: str) -> list[str]:
    """The overrides that make `shape` a rung of the ladder: its own, then its steps at the spec's tokens per
    parameter (a whole number of validations), its validation cadence and warm-up."""
    if shape == SINGLE:
        return []
    own = spec.shapes[shape]
    probe = arm_shape([*spec.base, *spec.baseline, *own])
    raw = spec.tokens_per_param * probe.params / probe.tokens_per_step
    every = max(1, round(raw / spec.validations))
    steps = every * spec.validations
    extra = [f"trainer.max_steps={steps}", f"trainer.val_every_steps={every}"]
    if spec.warmup_fraction is not None:
        extra.append(f"optim.warmup_steps={max(1, round(spec.warmup_fraction * steps))}")
    return [*own, *extra]


def fraction_steps(shape: Shape, fraction: float) -> int:
    """A shorter run's steps: `fraction` of the base as a whole number of validation intervals. A fraction
    that falls between two validations is refused (a run's label must be the length it trained)."""
    intervals = fraction * shape.steps / shape.val_every
    if abs(intervals - round(intervals)) > 1e-9 or round(intervals) < 1:
        step = shape.val_every / shape.steps
        raise Refused(
            f"fraction {fraction:g} of {shape.steps} steps is {intervals:g} validation intervals; use a "
            f"multiple of {step:g} (trainer.val_every_steps / trainer.max_steps)"
        )
    return round(intervals) * shape.val_every


# -- jobs ---------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One training run of the ablation."""

    arm: str
    seed: int
    fraction: float
    steps: int
    overrides: list[str]
    run_dir: Path
    shape: str = SINGLE
    lr: dict[str, float] = field(default_factory=dict)
    """The tuned values this run trains at ({} without an LR search)."""

    @property
    def name(self) -> str:
        tag = "".join(f"-{lr_tag(k)}{v:g}" for k, v in self.lr.items())
        part = f"-f{self.fraction:g}" if self.fraction < 1 else ""
        return f"{self.arm}{tag}{part}-s{self.seed}"

    @property
    def key(self) -> str:
        """Unique across the ladder: `<shape>/<name>`."""
        return f"{self.shape}/{self.name}" if self.shape else self.name


def lr_tag(key: str) -> str:
    """`optim.muon_lr` -> `muon_lr`: the tuned key as a run name shows it."""
    return key.rsplit(".", 1)[-1]


def make_job(
    spec: Spec, out: Path, shape: str, shape_overrides: list[str], arm: str, seed: int,
    lr: dict[str, float], fraction: float = 1.0, steps: int = 0,
) -> Job:  # fmt: skip
    """The run of `arm` at `shape` with `seed`, training at the tuned values `lr`."""
    root = out / "runs" / shape if shape else out / "runs"
    job = Job(arm, seed, fraction, steps, [], root, shape, dict(lr))
    job.run_dir = root / job.name
    extra = [] if fraction == 1.0 else [f"trainer.max_steps={steps}", f"optim.total_steps={steps}"]
    job.overrides = [
        *spec.base, *shape_overrides, *spec.arm_overrides(arm, shape), *(f"{k}={v:g}" for k, v in lr.items()),
        *extra,
        f"run.seed={seed}", f"run.root={root}", f"run.name={job.name}",
    ]  # fmt: skip
    return job


def plan_jobs(spec: Spec, out: Path, shapes: dict[str, Shape], lr: dict[str, dict[str, float]] | None = None,
              shape: str = SINGLE, shape_overrides: list[str] | None = None) -> list[Job]:  # fmt: skip
    """Every final run of one shape, seed by seed (so a partial ablation is balanced), the baseline first
    within a seed; `lr` gives each arm's tuned values."""
    jobs = []
    for seed in spec.seeds:
        for arm in spec.arms:
            lengths = [(1.0, shapes[arm].steps)]
            lengths += [(f, fraction_steps(shapes[arm], f)) for f in spec.fractions.get(arm, [])]
            for fraction, steps in lengths:
                tuned = (lr or {}).get(arm, {})
                jobs.append(
                    make_job(spec, out, shape, shape_overrides or [], arm, seed, tuned, fraction, steps)
                )
    return jobs


def arm_lr_keys(spec: Spec, arm: str, best: dict[str, dict[str, float]]) -> dict[str, float]:
    """The values an arm inherits from the baseline's search: every baseline-tuned key the arm does not tune
    itself (Muon's arm tunes `optim.muon_lr` and trains its AdamW groups at the baseline's best `optim.lr`)."""
    if not spec.lr or arm == BASELINE:
        return {}
    key, _ = spec.lr.grid_for(arm)
    return {k: v for k, v in best.get(BASELINE, {}).items() if k != key}


def extend(values: list[float], best: float, extensions: int, limit: int) -> float | None:
    """The next grid value past an optimum on the edge (one grid step beyond it, log-spaced), or None when the
    optimum is bracketed or the extensions are spent."""
    values = sorted(values)
    if extensions >= limit or len(values) < 2:
        return None
    if math.isclose(best, values[0]):
        return float(f"{values[0] * values[0] / values[1]:.3g}")
    if math.isclose(best, values[-1]):
        return float(f"{values[-1] * values[-1] / values[-2]:.3g}")
    return None
