"""Schemas of how the training steps are taken: the optimizer, the Trainer's loop, precision, activation
checkpointing, kernels, checkpoints, surviving preemption, logging."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lm.base.exits import Refused

PRECISIONS = ("auto", "bf16-mixed", "bf16-true", "16-mixed", "32-true")
FP8_RECIPES = ("tensorwise", "rowwise")
SCHEDULES = ("wsd", "cosine", "constant")
OPTIMIZERS = ("adamw", "muon")
MUON_LR_SCALES = ("match_rms_adamw", "original")
CHECKPOINT_FORMATS = ("full", "sharded")
NS_COEFFICIENTS = ("quintic", "polar_express")
POLAR_EXPRESS_STEPS = 5
"""The iterations Polar Express's published coefficients cover (lm.engine.optim.POLAR_EXPRESS)."""


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon with AdamW: lm.engine.optim) and its learning-rate schedule."""

    name: str = "adamw"
    """`adamw`, or `muon`: Muon on the blocks' matrices, AdamW (the keys below) on embedding, head and norms."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (end of the decay)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices; norms and biases are never decayed."""
    cautious_weight_decay: bool = False
    """Decay only the coordinates whose update has the parameter's sign (Chen et al. 2025, "Cautious weight
    decay", arXiv:2510.12402): a parameter the step pulls away from 0 is not also pushed towards it. Both
    optimizers, every decayed group (lm.engine.optim.cautious_decay); off: torch's decay, bitwise."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    warmup_steps: int = 50
    """Linear warm-up length in optimizer steps."""
    schedule: str = "wsd"
    """`wsd` (warmup-stable-decay: flat after warm-up, decayed over the last `decay_fraction`), `cosine` or `constant`."""
    decay_fraction: float = 0.2
    """Share of `total_steps` spent decaying under `wsd`."""
    total_steps: int | None = None
    """Steps the schedule spans; None uses trainer.max_steps. Set it to the whole plan when phases split a run."""
    fused: bool | None = None
    """Fused AdamW kernel; None turns it on exactly when training on CUDA."""
    muon_lr: float | None = None
    """Muon's peak LR; None uses `lr` (under `match_rms_adamw` the two share a scale). Same schedule."""
    muon_weight_decay: float | None = None
    """Muon's decoupled weight decay; None uses `weight_decay`."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum."""
    ns_steps: int = 5
    """Newton-Schulz iterations that orthogonalise each matrix's update (each costs the same under either
    `ns_coefficients`; at most 5 with `polar_express`)."""
    ns_coefficients: str = "quintic"
    """Muon's Newton-Schulz polynomial: `quintic` (torch's Muon: Keller Jordan's (3.4445, -4.775, 2.0315) at
    every iteration) or `polar_express` (Amsel et al. 2025: a different optimal quintic per iteration, closer
    to orthogonal in as many steps, so fewer steps can do; experiments/2026-11-25-muon-ns)."""
    adjust_lr: str = "match_rms_adamw"
    """Muon's per-matrix LR scale: `match_rms_adamw` (0.2·sqrt(max dim): AdamW's update RMS, so AdamW's LR
    carries over) or `original` (sqrt(max(1, rows/cols)), Keller Jordan's; needs a ~10-50x larger muon_lr)."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise Refused(
                f"optim.name='{self.name}' is unknown; use one of {', '.join(OPTIMIZERS)} (optim=muon)"
            )
        if self.adjust_lr not in MUON_LR_SCALES:
            raise Refused(
                f"optim.adjust_lr='{self.adjust_lr}' is unknown; use one of {', '.join(MUON_LR_SCALES)}"
            )
        if not 1 <= self.ns_steps < 100 or not 0.0 <= self.muon_momentum < 1.0:
            raise Refused("optim.ns_steps must lie in [1, 99] and optim.muon_momentum in [0, 1)")
        if self.ns_coefficients not in NS_COEFFICIENTS:
            raise Refused(
                f"optim.ns_coefficients='{self.ns_coefficients}' is unknown; use one of "
                f"{', '.join(NS_COEFFICIENTS)}"
            )
        if self.ns_coefficients == "polar_express" and self.ns_steps > POLAR_EXPRESS_STEPS:
            raise Refused(
                f"optim.ns_steps={self.ns_steps} with optim.ns_coefficients=polar_express: its published "
                f"coefficients cover {POLAR_EXPRESS_STEPS} iterations; set optim.ns_steps<={POLAR_EXPRESS_STEPS}"
            )
        if (self.muon_lr is not None and self.muon_lr <= 0) or (self.muon_weight_decay or 0.0) < 0:
            raise Refused("optim.muon_lr must be positive and optim.muon_weight_decay non-negative")
        if self.schedule not in SCHEDULES:
            raise Refused(f"optim.schedule='{self.schedule}' is unknown; use one of {', '.join(SCHEDULES)}")
        if not 0.0 <= self.decay_fraction <= 1.0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise Refused("optim.decay_fraction and optim.min_lr_ratio must lie in [0, 1]")
        if self.lr <= 0 or self.warmup_steps < 0:
            raise Refused("optim.lr must be positive and optim.warmup_steps non-negative")


@dataclass
class TrainerConfig:
    """The Lightning Trainer's loop settings (precision, callbacks and logger come from their own groups)."""

    accelerator: str = "auto"
    """`cpu`, `gpu` or `auto`."""
    devices: Any = 1
    """Devices per node: an int, a list of ids or `auto` (every device of the machine, as trainer=ddp and
    trainer=fsdp set it). 1: one device, whichever is present, so a plain run on a multi-GPU machine does not
    turn into data parallelism unasked."""
    num_nodes: int = 1
    """Machines in the job."""
    strategy: str = "auto"
    """Lightning strategy name (`auto`, `ddp`, ...); `fsdp` is FSDP2 per block (lm.engine.parallel.FSDP2Strategy)."""
    max_steps: int = 300
    """Optimizer steps at which this invocation stops (a resumed run counts from its checkpoint)."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step."""
    gradient_clip_val: float | None = 1.0
    """Clip the global gradient norm to this; None disables clipping."""
    val_every_steps: int = 100
    """Validate every this many optimizer steps (and at the end of the invocation)."""
    limit_val_batches: int = 16
    """Validation micro-batches per evaluation."""
    log_every_n_steps: int = 10
    """How often scalars go to the logger."""
    enable_progress_bar: bool = True
    """Show the progress bar."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other `lightning.Trainer` keyword, passed through unchanged."""

    def __post_init__(self) -> None:
        # Lightning reads max_steps=-1 as "no limit" and 0 as "nothing to do", and fails deep inside `fit` on a
        # zero interval: each is refused here, before the run directory is touched.
        counts = {
            "max_steps": "optimizer steps",
            "val_every_steps": "optimizer steps",
            "accumulate_grad_batches": "micro-batches",
            "log_every_n_steps": "steps",
            "num_nodes": "machines",
        }
        for name, unit in counts.items():
            if getattr(self, name) < 1:
                raise Refused(f"trainer.{name}={getattr(self, name)} must be a positive number of {unit}")
        if self.limit_val_batches < 0:
            raise Refused(
                f"trainer.limit_val_batches={self.limit_val_batches} must be >= 0 (0 turns validation off)"
            )


@dataclass
class PrecisionConfig:
    """Numeric precision of training."""

    mode: str = "auto"
    """Lightning precision: `bf16-mixed`, `bf16-true` (weights, gradients and AdamW moments in bf16: half the
    memory, less precise updates), `16-mixed` (with Lightning's dynamic loss scaler), `32-true`, or `auto`
    (bf16-mixed on GPUs that support it, 16-mixed on older GPUs, 32-true on CPU)."""
    tf32: bool = True
    """Let fp32 matmuls use TF32 tensor cores on Ampere and newer (free speed; ignored on CPU)."""
    fp8: str | None = None
    """FP8 matmuls in the blocks' linear layers (torchao float8 training): `tensorwise` (one scale per tensor,
    the faster) or `rowwise` (one per row, closer to bf16); None off. Beside `mode` (bf16-mixed): the
    embedding, the lm_head and attention's softmax stay in bf16. Needs compute capability 8.9+ and compile."""
    fp8_emulate: bool = False
    """Run the FP8 casts and scaled matmuls in emulation (any device, slow): tests the FP8 code path, the
    checkpoints and the export on a CPU. Never for a real run."""

    def __post_init__(self) -> None:
        if self.mode not in PRECISIONS:
            raise Refused(f"precision.mode='{self.mode}' is unknown; use one of {', '.join(PRECISIONS)}")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise Refused(f"precision.fp8='{self.fp8}' is unknown; use one of {', '.join(FP8_RECIPES)}")


@dataclass
class ActivationCheckpointingConfig:
    """Recompute block activations in the backward pass to save memory, at ~20-30% more compute."""

    every: int = 0
    """0 off; 1 checkpoints every block; k checkpoints every k-th block. Ignored when `auto` is set."""
    auto: bool = False
    """Choose `every` at start: the least checkpointing whose measured trial step (the real micro-batch,
    precision and kernels on the real GPU) fits in the free device memory minus `free_memory_reserve`. Off on a CPU."""
    free_memory_reserve: float = 0.1
    """Fraction of the free device memory `auto` leaves unused (compilation, evaluation, fragmentation); not
    `doctor.headroom`, a fraction of the whole device's memory."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise Refused("activation_checkpointing.every must be 0 (off) or a positive block stride")
        if not 0.0 <= self.free_memory_reserve < 1.0:
            raise Refused(
                "activation_checkpointing.free_memory_reserve must lie in [0, 1): a fraction of free memory"
            )


@dataclass
class KernelsConfig:
    """How the model's forward and backward are executed."""

    compile: bool | None = None
    """`torch.compile` the model; None compiles exactly when training on CUDA."""
    compile_mode: str | None = None
    """torch.compile mode (`default`, `reduce-overhead`, `max-autotune`); None is the default."""
    liger: bool = False
    """Liger Kernel's Triton RMSNorm, SwiGLU, RoPE and fused linear cross-entropy (CUDA only; needs the
    `gpu` extra). Same parameters and checkpoints as the eager model."""


@dataclass
class CheckpointConfig:
    """How often checkpoints are written and how many are kept."""

    every_n_steps: int = 100
    """Write `step-<N>.ckpt` and refresh `last.ckpt` every this many optimizer steps (and at the end)."""
    keep_last: int = 3
    """Step checkpoints kept, newest by step number (-1 keeps all); `last.ckpt` is a link to the newest."""
    remote: str | None = None
    """Object-storage root mirroring `run.root` (`s3://bucket/runs`, `gs://...`, `file:///mnt/x`): every step
    checkpoint is also uploaded to `<remote>/<run name>/checkpoints/`, and a run whose local directory has
    no newer checkpoint (a new machine, another region) resumes from there. None keeps checkpoints local."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for `remote` (e.g. `endpoint_url`, `profile`); credentials are better left to the
    environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS)."""
    upload_timeout_s: float | None = 600.0
    """How long a stop signal, a crash or the end of the run waits for the upload in flight before the process
    exits anyway (a hung connection must not hold a stopping run, nor a spot machine past its notice). The
    bucket then still holds the previous complete checkpoint; the local one is intact. None waits forever."""
    remote_best_effort: bool = False
    """An upload the bucket refuses mid-run (access denied, the bucket deleted) stops the run with exit 74 on
    every rank, its local checkpoints intact; true logs it and trains on without a mirror."""
    retry_window_s: float = 300.0
    """How long an outage of `remote` (connection refused or reset, timeouts, 5xx, throttling) is retried inside
    the process, with exponential backoff, before the run exits 69 for `lm supervise` to restart it later. A
    refusal (no bucket, access denied, no credentials) is never retried: it exits 78."""
    format: str = "full"
    """`full`: one file a checkpoint, gathered on rank 0 (any strategy; resumable on any world size, the better
    deal up to a few billion parameters: `lm plan` and the doctor say where it stops being). `sharded`
    (trainer=fsdp): a folder a checkpoint, every rank writing its own shards with torch.distributed.checkpoint,
    no full copy in any host's memory; resumable on any world size too, and read by export/sample/eval."""
    async_save: bool = False
    """With format=sharded: stage the shards to (pinned) host memory and write them while training goes on; at
    most one save in flight, finished before the next save and before the process exits."""
    run_id: str | None = None
    """Continue the run with this id (see run.json and the bucket's latest.json) although this config differs
    from the one that started it; None: this directory's run, or on a new machine the bucket's run if the
    config matches, else a refusal."""

    def __post_init__(self) -> None:
        if self.retry_window_s < 0:
            raise Refused(
                f"checkpoint.retry_window_s={self.retry_window_s} must be >= 0 seconds (0: fail at the first outage)"
            )
        if self.remote is not None and not self.remote.partition("://")[2].strip("/"):
            raise Refused(
                f"checkpoint.remote={self.remote!r} is not a URL that names a bucket; use s3://bucket/prefix, "
                f"gs://bucket/prefix or file:///path (or null to keep checkpoints local)"
            )
        if self.upload_timeout_s is not None and self.upload_timeout_s <= 0:
            raise Refused(
                f"checkpoint.upload_timeout_s={self.upload_timeout_s} must be > 0 seconds, or null to wait for "
                f"the upload however long it takes"
            )
        if self.format not in CHECKPOINT_FORMATS:
            raise Refused(
                f"checkpoint.format='{self.format}' is unknown; use one of {', '.join(CHECKPOINT_FORMATS)}"
            )
        if self.async_save and self.format != "sharded":
            raise Refused(
                "checkpoint.async_save=true writes sharded checkpoints in the background; set "
                "checkpoint.format=sharded (with trainer=fsdp) or drop checkpoint.async_save"
            )
        if self.every_n_steps < 1 or (self.keep_last < 1 and self.keep_last != -1):
            raise Refused(
                "checkpoint.every_n_steps must be >= 1 and checkpoint.keep_last >= 1 (or -1 to keep all): "
                "a run with no step checkpoint has nothing to resume from"
            )


@dataclass
class GuardConfig:
    """The run's guards (the `guards` group, `spot` until 2026-11-28): stop signals, the throughput alarm,
    NaN/inf and spiking losses."""

    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])
    """Signals that save a checkpoint at the next step boundary and exit with code 75 (restart me). Ctrl-C
    (SIGINT) saves too; a second Ctrl-C stops at once (Lightning's interrupt: exit 1, the last checkpoint kept)."""
    slow_ratio: float = 0.6
    """Throughput alarm: tokens/s below this fraction of the run's own baseline ..."""
    slow_window_s: float = 120.0
    """... for this many seconds in a row saves a checkpoint and warns (a degrading host is often reclaimed)."""
    baseline_steps: int = 20
    """Steps after the first `warmup` whose median tokens/s is the baseline."""
    baseline_warmup: int = 5
    """Steps ignored before measuring the baseline (compilation, cold caches)."""
    max_nonfinite: int = 3
    """Non-finite losses in a row before rolling back to the last checkpoint; fewer are skipped steps."""
    spike_factor: float | None = 2.0
    """A step whose (finite) loss exceeds this many times the median of the last `spike_window` losses is a
    spike and is skipped like a NaN step; null turns spike detection off. 2 is llm-foundry's multiplier: a
    healthy run's loss stays well within it, while a blow-up or a corrupt batch jumps past it."""
    spike_window: int = 50
    """Recent accepted losses the median is taken over; detection is off until the window is full (the early,
    fast-falling loss), and spikes are counted over this many steps."""
    max_spikes: int = 3
    """Spikes within `spike_window` steps that roll back to the last checkpoint (exit 75) and skip the data
    trained on since it; a second rollback to the same checkpoint exits 65."""

    def __post_init__(self) -> None:
        if not 0.0 < self.slow_ratio < 1.0 or self.slow_window_s <= 0:
            raise Refused("guards.slow_ratio must lie in (0, 1) and guards.slow_window_s be positive")
        if self.baseline_steps < 1 or self.baseline_warmup < 0 or self.max_nonfinite < 1:
            raise Refused(
                "guards.baseline_steps and guards.max_nonfinite must be >= 1, guards.baseline_warmup >= 0"
            )
        if self.spike_factor is not None and self.spike_factor <= 1.0:
            raise Refused(
                f"guards.spike_factor={self.spike_factor} would call ordinary losses spikes: use a factor "
                "above 1 (default 2) or guards.spike_factor=null to turn spike detection off"
            )
        if self.spike_window < 3 or self.max_spikes < 1:
            raise Refused(
                f"guards.spike_window={self.spike_window} and guards.max_spikes={self.max_spikes}: a median "
                "needs a window of at least 3 losses, and max_spikes must be >= 1"
            )


@dataclass
class LoggerConfig:
    """TensorBoard logging into `<run dir>/tb/`."""

    tensorboard: bool = True
    """Write TensorBoard events."""
