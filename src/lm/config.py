"""Typed schemas of the config tree, registered with Hydra's ConfigStore.

`conf/train.yaml` starts from the `lm_schema` node, so every group file and every override is checked against
these dataclasses at compose time: `model.n_layr=3` or `trainer.max_steps=abc` fails before anything is built.
Third-party objects (extra Lightning callbacks) stay plain `_target_` YAML.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from lm.model import ModelConfig
from lm.store.exits import EXIT_CONFIG

PRECISIONS = ("auto", "bf16-mixed", "bf16-true", "16-mixed", "32-true")
PRICINGS = ("on_demand", "spot")
SCHEDULES = ("wsd", "cosine", "constant")
OPTIMIZERS = ("adamw", "muon")
MUON_LR_SCALES = ("match_rms_adamw", "original")


SOURCES = ("stdlib", "text", "hf", "tokens")
VERIFY = ("size", "cached", "full")
ON_EXHAUSTED = ("stop", "renormalise")


@dataclass
class MixtureSource:
    """One corpus of a weighted data mixture (`data.mixture`, lm.data.mixture)."""

    name: str = "???"
    """Names the source in messages and in its metric `val/loss/<name>`."""
    weight: float = 1.0
    """Share of the training windows (weights are normalised over the sources)."""
    dir: str | None = None
    """A folder `lm prepare` wrote, or its URL, as `data=tokens` takes it."""
    data: dict[str, Any] = field(default_factory=dict)
    """Instead of `dir`: the data.* fields of a corpus to prepare (`{source: text, paths: [...]}`); the
    fields it leaves out come from `data` (seq_len, vocab_size, tokenizer, cache_dir...)."""
    max_epochs: float | None = None
    """Cap on passes over this source's training windows; None repeats it as often as the weight asks."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(
                f"data.mixture source name {self.name!r} must be letters, digits, '_', '-' or '.' (it becomes "
                f"the metric val/loss/<name>)"
            )
        if (self.dir is None) == (not self.data):
            raise ValueError(
                f"data.mixture source '{self.name}' needs exactly one of dir (a prepared folder) or data "
                f"(a corpus to prepare, e.g. {{source: text, paths: ['corpus/*.txt']}})"
            )
        if self.weight < 0 or (self.max_epochs is not None and self.max_epochs <= 0):
            raise ValueError(
                f"data.mixture source '{self.name}': weight={self.weight} must be >= 0 and max_epochs="
                f"{self.max_epochs} positive or null"
            )


@dataclass
class DataConfig:
    """Where the tokens come from and how they are batched."""

    source: str = "stdlib"
    """`stdlib` (the interpreter's standard library source, bundled with every Python), `text` (local files:
    .txt/.md, .jsonl, .parquet, optionally .gz), `hf` (a Hugging Face dataset, streamed) or `tokens` (a folder
    that `lm prepare` already wrote)."""
    paths: Any = None
    """`text`: a glob or a list of globs (`corpus/**/*.jsonl`); `hf`: optional data files for the builder."""
    text_field: str = "text"
    """Field (.jsonl) or column (.parquet, `hf`) that holds each document's text."""
    name: str | None = None
    """`hf`: the dataset name (`HuggingFaceFW/fineweb-edu`, or a builder such as `json`)."""
    subset: str | None = None
    """`hf`: the dataset configuration (`sample-10BT`)."""
    split: str = "train"
    """`hf`: the split to read; validation is carved out of it by document."""
    dir: str | None = None
    """Folder of the prepared shards. `tokens`: required; other sources: None uses cache_dir/<source>-<hash>.
    A URL (`s3://bucket/tokens`) is object storage: `tokens` downloads it into cache_dir (every shard checked
    against the manifest's sha256); other sources prepare into cache_dir and upload there."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for a `dir` URL (e.g. `endpoint_url`); credentials come from the environment."""
    tokenizer: str | None = None
    """A tokenizer.json path or a Hugging Face tokenizer name; None trains a byte-level BPE on the corpus.
    With `tokens`, the shards must have been made by this tokenizer (checked by sha256)."""
    eot_token: str = "<|endoftext|>"
    """End-of-text token appended to every document; a loaded tokenizer must have it."""
    cache_dir: str = "${oc.env:LM_CACHE,${oc.env:HOME}/.cache/lm}"
    """Folder for trained tokenizers and token shards; one sub-folder per prepared dataset."""
    vocab_size: int = 4096
    """Id space of the model's embedding (padded up from it); a trained BPE gets exactly this many tokens."""
    seq_len: int = 256
    """Tokens per training window (the model sees seq_len inputs and predicts seq_len targets)."""
    batch_size: int = 16
    """Windows per micro-batch per device; tokens per optimizer step = batch_size x seq_len x accumulation x devices."""
    val_fraction: float = 0.02
    """Share of documents held out for validation, chosen by a hash of each document's name."""
    max_bytes: int | None = None
    """Read at most about this many bytes of the corpus (whole files or documents); None reads all of it."""
    tokenizer_sample_bytes: int = 8_000_000
    """The tokenizer is trained on at most this many bytes of the training documents."""
    shard_bytes: int = 256_000_000
    """Input bytes per unit of work; each unit writes one train and one val shard and is resumed as a whole."""
    num_proc: int | None = None
    """Processes that tokenize in `prepare`; None uses every core."""
    max_line_chars: int = 1_000_000
    """Documents with a longer line (minified code, base64 blobs) are skipped and reported: BPE on one giant
    pre-token is slow and they are rarely language."""
    num_workers: int = 2
    """DataLoader worker processes; 0 loads batches in the training process and stalls the GPU."""
    pin_memory: bool = True
    """Page-locked host buffers for faster host-to-GPU copies (ignored without CUDA)."""
    persistent_workers: bool = True
    """Keep workers alive between validation and training instead of re-forking them."""
    seed: int = 0
    """Seed of the window order; order is a pure function of (seed, global step)."""
    verify: str = "cached"
    """How training checks the prepared shards against their manifest before it reads them: `size` (every
    file's size), `cached` (also each shard's sha256 and largest token id, computed once per file and
    remembered in the folder's `verified.json` by size and modification time, so later runs only stat the
    files), or `full` (recompute both on every run)."""
    mixture: list[MixtureSource] = field(default_factory=list)
    """Several corpora trained on together, each window drawn from a source in proportion to its weight
    (lm.data.mixture); the source fields above are then unused. Empty: the one corpus described above."""
    on_exhausted: str = "stop"
    """When a source reaches its max_epochs: `stop` the run there, or `renormalise` the other weights."""

    def check_inputs(self) -> None:
        """The source's required fields; checked when data is prepared, so every data=* option composes."""
        if self.source == "text" and not self.paths:
            raise ValueError("data=text needs data.paths, e.g. data.paths='corpus/**/*.txt'")
        if self.source == "hf" and not self.name:
            raise ValueError("data=hf needs data.name, e.g. data.name=HuggingFaceFW/fineweb-edu")
        if self.source == "tokens" and not self.dir:
            raise ValueError("data=tokens needs data.dir, the folder `lm prepare` wrote")

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(
                f"data.source {self.source!r} is unknown; use one of {', '.join(SOURCES)} (e.g. data=text)"
            )
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if self.paths is not None and not (
            isinstance(self.paths, (list, tuple)) and all(isinstance(p, str) for p in self.paths)
        ):
            raise ValueError(f"data.paths={self.paths!r} must be a glob or a list of globs")
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError(
                f"data.seq_len={self.seq_len} and data.batch_size={self.batch_size} must be >= 1"
            )
        if self.shard_bytes < 1 or (self.num_proc is not None and self.num_proc < 1):
            raise ValueError(
                "data.shard_bytes and data.num_proc must be positive (num_proc null = every core)"
            )
        if self.max_line_chars < 1:
            raise ValueError(f"data.max_line_chars={self.max_line_chars} must be positive")
        if self.verify not in VERIFY:
            raise ValueError(f"data.verify={self.verify!r} is unknown; use one of {', '.join(VERIFY)}")
        if self.on_exhausted not in ON_EXHAUSTED:
            raise ValueError(
                f"data.on_exhausted={self.on_exhausted!r} is unknown; use one of {', '.join(ON_EXHAUSTED)}"
            )
        names = [s.name for s in self.mixture]
        if len(set(names)) < len(names) or (self.mixture and not sum(s.weight for s in self.mixture) > 0):
            raise ValueError(
                f"data.mixture needs distinct source names and a positive total weight; got {names}"
            )


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
    """Newton-Schulz iterations that orthogonalise each matrix's update."""
    adjust_lr: str = "match_rms_adamw"
    """Muon's per-matrix LR scale: `match_rms_adamw` (0.2·sqrt(max dim): AdamW's update RMS, so AdamW's LR
    carries over) or `original` (sqrt(max(1, rows/cols)), Keller Jordan's; needs a ~10-50x larger muon_lr)."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(
                f"optim.name='{self.name}' is unknown; use one of {', '.join(OPTIMIZERS)} (optim=muon)"
            )
        if self.adjust_lr not in MUON_LR_SCALES:
            raise ValueError(
                f"optim.adjust_lr='{self.adjust_lr}' is unknown; use one of {', '.join(MUON_LR_SCALES)}"
            )
        if not 1 <= self.ns_steps < 100 or not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError("optim.ns_steps must lie in [1, 99] and optim.muon_momentum in [0, 1)")
        if (self.muon_lr is not None and self.muon_lr <= 0) or (self.muon_weight_decay or 0.0) < 0:
            raise ValueError("optim.muon_lr must be positive and optim.muon_weight_decay non-negative")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"optim.schedule='{self.schedule}' is unknown; use one of {', '.join(SCHEDULES)}"
            )
        if not 0.0 <= self.decay_fraction <= 1.0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("optim.decay_fraction and optim.min_lr_ratio must lie in [0, 1]")
        if self.lr <= 0 or self.warmup_steps < 0:
            raise ValueError("optim.lr must be positive and optim.warmup_steps non-negative")


@dataclass
class TrainerConfig:
    """The Lightning Trainer's loop settings (precision, callbacks and logger come from their own groups)."""

    accelerator: str = "auto"
    """`cpu`, `gpu` or `auto`."""
    devices: Any = "auto"
    """Devices per node: an int, a list of ids or `auto`."""
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
                raise ValueError(f"trainer.{name}={getattr(self, name)} must be a positive number of {unit}")
        if self.limit_val_batches < 0:
            raise ValueError(
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

    def __post_init__(self) -> None:
        if self.mode not in PRECISIONS:
            raise ValueError(f"precision.mode='{self.mode}' is unknown; use one of {', '.join(PRECISIONS)}")


@dataclass
class ActivationCheckpointingConfig:
    """Recompute block activations in the backward pass to save memory, at ~20-30% more compute."""

    every: int = 0
    """0 off; 1 checkpoints every block; k checkpoints every k-th block. Ignored when `auto` is set."""
    auto: bool = False
    """Choose `every` at start: the least checkpointing whose measured trial step (the real micro-batch,
    precision and kernels on the real GPU) fits in the free device memory minus `headroom`. Off on a CPU."""
    headroom: float = 0.1
    """Fraction of the free device memory `auto` leaves unused (compilation, evaluation, fragmentation)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError("activation_checkpointing.every must be 0 (off) or a positive block stride")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(
                "activation_checkpointing.headroom must lie in [0, 1): a fraction of free memory"
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
    retry_window_s: float = 300.0
    """How long an outage of `remote` (connection refused or reset, timeouts, 5xx, throttling) is retried inside
    the process, with exponential backoff, before the run exits 69 for `lm supervise` to restart it later. A
    refusal (no bucket, access denied, no credentials) is never retried: it exits 78."""
    run_id: str | None = None
    """Continue the run with this id (see run.json and the bucket's latest.json) although this config differs
    from the one that started it; None: this directory's run, or on a new machine the bucket's run if the
    config matches, else a refusal."""

    def __post_init__(self) -> None:
        if self.retry_window_s < 0:
            raise ValueError(
                f"checkpoint.retry_window_s={self.retry_window_s} must be >= 0 seconds (0: fail at the first outage)"
            )
        if self.remote is not None and not self.remote.partition("://")[2].strip("/"):
            raise ValueError(
                f"checkpoint.remote={self.remote!r} is not a URL that names a bucket; use s3://bucket/prefix, "
                f"gs://bucket/prefix or file:///path (or null to keep checkpoints local)"
            )
        if self.upload_timeout_s is not None and self.upload_timeout_s <= 0:
            raise ValueError(
                f"checkpoint.upload_timeout_s={self.upload_timeout_s} must be > 0 seconds, or null to wait for "
                f"the upload however long it takes"
            )
        if self.every_n_steps < 1 or (self.keep_last < 1 and self.keep_last != -1):
            raise ValueError(
                "checkpoint.every_n_steps must be >= 1 and checkpoint.keep_last >= 1 (or -1 to keep all): "
                "a run with no step checkpoint has nothing to resume from"
            )


@dataclass
class SpotConfig:
    """Surviving preemption and sick hosts: stop signals, the throughput alarm, NaN/inf and spiking losses."""

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
            raise ValueError("spot.slow_ratio must lie in (0, 1) and spot.slow_window_s be positive")
        if self.baseline_steps < 1 or self.baseline_warmup < 0 or self.max_nonfinite < 1:
            raise ValueError("spot.baseline_steps and spot.max_nonfinite must be >= 1, baseline_warmup >= 0")
        if self.spike_factor is not None and self.spike_factor <= 1.0:
            raise ValueError(
                f"spot.spike_factor={self.spike_factor} would call ordinary losses spikes: use a factor above 1 "
                "(default 2) or spot.spike_factor=null to turn spike detection off"
            )
        if self.spike_window < 3 or self.max_spikes < 1:
            raise ValueError(
                f"spot.spike_window={self.spike_window} and spot.max_spikes={self.max_spikes}: a median needs a "
                "window of at least 3 losses, and max_spikes must be >= 1"
            )


@dataclass
class LoggerConfig:
    """TensorBoard logging into `<run dir>/tb/`."""

    tensorboard: bool = True
    """Write TensorBoard events."""


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
            raise ValueError(f"cost.pricing='{self.pricing}' is unknown; use one of {', '.join(PRICINGS)}")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise ValueError("cost.price_per_hour must be non-negative")


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
            raise ValueError(f"phase '{self.name}' needs exactly one of end_step or end_tokens")
        if any(w < 0 for w in (self.mixture or {}).values()):
            raise ValueError(f"phase '{self.name}': mixture weights {self.mixture} must be >= 0")


@dataclass
class PhasesConfig:
    """The run as a sequence of phases (`conf/phases/*.yaml`), in order."""

    plan: str = ""
    """Name of the plan."""
    phases: list[PhaseConfig] = field(default_factory=list)
    """Phases in training order; their ends must increase."""

    def __post_init__(self) -> None:
        ends = [(p.end_step, p.end_tokens) for p in self.phases]
        for (s0, t0), (s1, t1), p in zip(ends, ends[1:], self.phases[1:]):
            if (s0 is not None and s1 is not None and s1 <= s0) or (
                t0 is not None and t1 is not None and t1 <= t0
            ):
                raise ValueError(
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
            raise ValueError(
                "sampling.every_n_steps must be >= 0, sampling.max_new_tokens >= 1 and sampling.temperature >= 0"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("sampling.top_k must be a positive integer or null (the whole vocabulary)")


@dataclass
class EvalsConfig:
    """Benchmarks at milestones (`conf/evals/*.yaml`): lm-evaluation-harness tasks run by rank 0 during
    training, logged as `eval/<task>/<metric>` and charged to the `eval` cost bucket."""

    tasks: list[str] = field(default_factory=list)
    """lm-eval task names (loglikelihood tasks: arc_easy, piqa, hellaswag...); an empty list turns it off."""
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
    """Sequences per forward pass of the evaluation."""

    def __post_init__(self) -> None:
        if (
            (self.limit is not None and self.limit < 1)
            or self.batch_size < 1
            or any(s < 1 for s in self.steps)
        ):
            raise ValueError(
                "evals.limit must be a positive count of examples or null (all), evals.batch_size >= 1 and "
                "evals.steps positive optimizer steps"
            )


@dataclass
class EarlyStoppingConfig:
    """When to stop before `trainer.max_steps` (`conf/early_stopping/*.yaml`); every criterion is optional.

    The validation-loss history and the loss forecast are tracked even when no criterion is set (`off`).
    """

    max_usd_per_loss_point: float | None = None
    """Stop when the marginal dollars per point of validation loss exceed this (the seed stopped at ~$550)."""
    window: int = 4
    """Validation points in the trailing window the marginal $/loss point is measured over."""
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

    def __post_init__(self) -> None:
        if self.window < 1 or not 0.0 <= self.smoothing < 1.0 or not 0.0 <= self.cooldown_fraction <= 1.0:
            raise ValueError(
                "early_stopping.window must be >= 1, smoothing in [0, 1) and cooldown_fraction in [0, 1]"
            )
        if self.forecast_min_points < 3:
            raise ValueError("early_stopping.forecast_min_points must be >= 3 (the curve has 3 parameters)")
        if self.patience is not None and self.patience < 1:
            raise ValueError("early_stopping.patience must be a positive count of validation points or null")


ASSUMED_MFU = 0.45
"""MFU assumed where none was measured on a GPU (the doctor's and `lm sky`'s $/token): the 1b model measured
50.8% on an H100 with compile (experiments/2026-11-23-gpu) and the seed's A100 run ~60% under this FLOPs count;
0.45 leaves room for a cloud VM's slower data path and for configurations that are not the default."""


@dataclass
class DoctorConfig:
    """The preflight doctor (lm.run.doctor): run at the start of every training run and by `lm doctor`."""

    enabled: bool = True
    """Run the checks before training starts (errors always refuse the run; warnings are logged)."""
    strict: bool = False
    """Treat warnings as errors: the run refuses to start until every finding is fixed."""
    assumed_mfu: float = ASSUMED_MFU
    """MFU assumed for $/token comparisons across the GPU catalog when no `lm bench` result is given (the
    same as `lm sky`'s, ASSUMED_MFU above, where the evidence for it is)."""
    headroom: float = 0.05
    """Share of device memory kept free when deciding whether a run fits."""

    def __post_init__(self) -> None:
        if not 0.0 < self.assumed_mfu <= 1.0 or not 0.0 <= self.headroom < 1.0:
            raise ValueError("doctor.assumed_mfu must lie in (0, 1] and doctor.headroom in [0, 1)")


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
            raise ValueError("bench.warmup_steps must be >= 0 and bench.steps >= 1")
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise ValueError("bench.memory_limit_gb must be positive or null")


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
    spot: SpotConfig = field(default_factory=SpotConfig)
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
            raise ValueError(
                f"model.max_seq_len={m.max_seq_len} is shorter than data.seq_len={d.seq_len}: the rotary "
                f"tables would not cover a training window; set model.max_seq_len>={d.seq_len} (or leave it "
                f"at its default, ${{data.seq_len}})"
            )
        if m.init_from is not None and d.tokenizer is None:  # the model's ids are its tokenizer's ids
            d.tokenizer = init_tokenizer(m.init_from)
        if m.vocab_size < d.vocab_size:
            raise ValueError(
                f"model.vocab_size={m.vocab_size} is smaller than data.vocab_size={d.vocab_size}: token ids "
                f"would overflow the embedding; set model.vocab_size>={d.vocab_size} (or leave it at its "
                f"default, ${{data.vocab_size}})"
            )
        known = {s.name for s in d.mixture}
        for phase in self.phases.phases:
            unknown = sorted(set(phase.mixture or {}) - known)
            if unknown:
                raise ValueError(
                    f"phase '{phase.name}' sets mixture weights of {unknown}, which data.mixture does not "
                    f"list (its sources: {sorted(known) or 'none'}); use their names"
                )
        if self.optim.name == "muon" and self.trainer.strategy == "fsdp":
            # torch.optim.Muon would orthogonalise each rank's DTensor shard, not the whole matrix.
            raise ValueError(
                "optim=muon cannot run with trainer=fsdp: Newton-Schulz needs each whole matrix and FSDP2 "
                "gives every rank a shard; use trainer=ddp (or a single device), or optim=adamw with FSDP"
            )


def init_tokenizer(init_from: str) -> str:
    """The tokenizer of `model.init_from`: its folder's tokenizer.json, or the Hub name itself."""
    folder = Path(init_from).expanduser()
    if not folder.is_dir():
        return init_from
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(
            f"model.init_from={init_from} holds no tokenizer.json; set data.tokenizer to the tokenizer its "
            "weights were trained with (a tokenizer.json or a Hugging Face name)"
        )
    return str(folder / "tokenizer.json")


def conf_dir() -> Path:
    """The Hydra config folder: $LM_CONF, else ./conf, else the checkout this package was installed from."""
    candidates = [os.environ.get("LM_CONF"), "conf", Path(__file__).resolve().parents[2] / "conf"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "train.yaml").is_file():
            return Path(candidate).resolve()
    raise FileNotFoundError(
        "no conf/train.yaml found; run from the project root or set LM_CONF=/path/to/conf"
    )


def register_configs() -> None:
    """Make the schemas visible to Hydra (idempotent)."""
    ConfigStore.instance().store(name="lm_schema", node=LMConfig)


def compose(overrides: list[str]) -> DictConfig:
    """conf/train.yaml with command-line style overrides, as `python train.py` would compose it."""
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def to_objects(cfg: DictConfig) -> LMConfig:
    """Resolve the composed config into dataclasses, running every `__post_init__` check.

    Compose-time typing catches unknown keys and wrong types; this catches values that are individually
    well-typed but wrong together (d_model not divisible by n_head, an unknown precision).
    """
    try:
        node = OmegaConf.to_object(cfg)  # builds each dataclass, so every __post_init__ check runs here
    except OmegaConfBaseException as e:  # a `???` left unset, an interpolation that does not resolve
        raise ValueError(f"the config does not resolve: {e}".replace("\n", "; ")) from e
    if not isinstance(node, LMConfig):
        raise TypeError("conf/train.yaml must list `lm_schema` first in its defaults so the tree is typed")
    return node


class CheckBeforeRun(Callback):
    """Hydra callback (conf/train.yaml): a single run's config is checked by `to_objects` before Hydra makes
    the invocation's output folder (`hydra/<time>/` in the run directory), so a refused config changes
    nothing on disk. Each job of a multirun is checked by `lm.run.train.main` instead, where a refusal fails that
    job alone and the sweep goes on."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        task = copy.deepcopy(config)
        with read_write(task), open_dict(task):
            del task["hydra"]  # what the task receives (hydra's run_job strips it the same way)
        try:
            to_objects(task)
        except ValueError as e:
            # Hydra turns an exception in a callback into a warning and runs the job anyway; an exit passes.
            print(f"train.py: {e}", file=sys.stderr)
            raise SystemExit(EXIT_CONFIG) from e
