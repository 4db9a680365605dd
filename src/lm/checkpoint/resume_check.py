"""The resume check: a resumed run continues the checkpoint's model on every rank, and says which settings
changed. `check_resumable` refuses before the run starts; the `ResumeCheck` callback checks the ranks and logs
the changes at train start. (Beside `lm.checkpoint.checkpointer`, which finds the checkpoint.)

Decided per key, because Lightning restores the optimizer and schedule from the checkpoint while config.yaml
records today's command:
- the architecture (`architecture()`: what the weights' shapes and rows mean) cannot change: `check_resumable`
  refuses before anything is written (exit 78) and names the fix;
- every other `model` and `optim` key, the LR schedule's span and gradient clipping can change mid-run (a phase
  may change them): they are applied from the resumed step on (`LMModule.apply_optim_config`) and logged;
- the data stream: `data.seq_len` (where windows are cut) and `data.seed` (their order) cannot change
  (`stream_keys`, refused by `check_resumable`); the global batch, the prepared data and a mixture's sources,
  weights, caps and phase weights can (a curriculum decision, a smaller machine): they are applied and
  logged with what they do to exact resume (`stream_settings`, `EFFECT`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lm.base.exits import Refused
from lm.checkpoint import files
from lm.checkpoint.callback import Agreement, Alone
from lm.checkpoint.run_state import from_checkpoint
from lm.config import DataConfig
from lm.data.datamodule import LMDataModule
from lm.model import ModelConfig

log = logging.getLogger(__name__)


def saved_settings(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The run settings a checkpoint was trained with that are not hyper-parameters (the schedule's span,
    clipping, the data stream): RunState's `settings`."""
    return (from_checkpoint(ckpt) or {}).get("settings", {})


GLOBAL_BATCH = "samples per step (data.batch_size x devices x nodes x accumulation)"
RAMP = "data.batch_ramp_steps, data.batch_ramp_start"
STREAM_DIFFERS = "the data stream from step {step} on differs from an uninterrupted run's"
REALLOCATED = (
    "the mixture's allocation is recomputed from step 0 with it, so each source continues where the new "
    "allocation is at step {step} (some windows are read again, others skipped): " + STREAM_DIFFERS + ". A "
    "planned change of weights is a phase with its own `mixture`, which continues every source's count"
)
EFFECT = {
    GLOBAL_BATCH: "the stream position is step x global batch, so windows are re-read or skipped: "
    + STREAM_DIFFERS,
    RAMP: "the stream position is the samples of the steps before, so windows are re-read or skipped: "
    + STREAM_DIFFERS,
    "prepared shards": "other tokens from here on (and another validation set): " + STREAM_DIFFERS,
    "data.mixture": REALLOCATED,
    "data.on_exhausted": REALLOCATED,
    "phases.": REALLOCATED,
}
"""What an applied change of a data-stream setting does to exact resume, by a part of its key (the first that
matches): logged with the change."""


def stream_keys(data: DataConfig) -> dict[str, Any]:
    """The data-stream settings a checkpoint cannot continue under another value of: windows are cut from the
    token stream every `seq_len` tokens and visited in an order seeded by `seed`, so the resumed position
    (step x global batch windows) would name other tokens."""
    return {"data.seq_len": data.seq_len, "data.seed": data.seed}


def shards_identity(manifest: dict[str, Any]) -> str:
    """A prepared dataset by its contents, not its folder (a copy on a faster disk is the same stream)."""
    shas = [s["sha256"] for split in ("train", "val") for s in manifest["splits"][split]["shards"]]
    digest = hashlib.sha256("".join(shas).encode()).hexdigest()[:12]
    return f"{manifest['splits']['train']['tokens']:,} train tokens, shards sha256 {digest}"


def stream_settings(trainer: pl.Trainer) -> dict[str, Any]:
    """What the training stream is, by the key a user sets: the refused keys (`stream_keys`), the global
    batch, the prepared data by contents, and a mixture's sources, normalised weights, caps and phase weights.
    Empty without a data module (a module trained on its own loaders)."""
    dm = trainer.datamodule
    if not isinstance(dm, LMDataModule):
        return {}
    data = dm.cfg
    batch = data.batch_size * trainer.world_size * trainer.accumulate_grad_batches
    out = {**stream_keys(data), GLOBAL_BATCH: batch, RAMP: [data.batch_ramp_steps, data.batch_ramp_start]}
    if not data.mixture:
        return {**out, "data (prepared shards)": shards_identity(dm.manifest)}
    total = sum(s.weight for s in data.mixture)
    out["data.mixture (sources)"] = [s.name for s in data.mixture]
    for source, manifest in zip(data.mixture, dm.manifests):
        out[f"data.mixture.{source.name}.weight"] = round(source.weight / total, 6)
        out[f"data.mixture.{source.name}.max_epochs"] = source.max_epochs
        out[f"data.mixture.{source.name} (prepared shards)"] = shards_identity(manifest)
    out["data.on_exhausted"] = data.on_exhausted
    for phase in dm.phases:
        out[f"phases.{phase.name}.mixture"] = dict(phase.mixture) if phase.mixture else None
    return out


def effect(key: str, step: int) -> str:
    """What changing `key` at `step` does to exact resume ('' for a setting that leaves the stream alone)."""
    found = next((text for part, text in EFFECT.items() if part in key), "")
    return found.format(step=step)


def architecture(cfg: ModelConfig) -> dict[str, Any]:
    """What the weights are, by the key a user sets: their shapes, what their rows mean (token ids), and the
    initialisation they came from. Defaults are resolved (`n_kv_head=None` is `n_head`)."""
    return {
        "model.vocab_size": cfg.vocab_size,
        "model.vocab_multiple (padded vocabulary)": cfg.padded_vocab_size,
        "model.n_layer": cfg.n_layer,
        "model.d_model": cfg.d_model,
        "model.n_head": cfg.n_head,
        "model.n_kv_head": cfg.kv_heads,
        "model.ffn_hidden / ffn_multiple (SwiGLU width)": cfg.hidden_dim,
        "model.tie_embeddings": cfg.tie_embeddings,
        "model.init_std": cfg.init_std,
    }


def check_resumable(
    ckpt_path: Path | None, model: ModelConfig, optimizer: str = "adamw", data: DataConfig | None = None
) -> None:
    """Refuse to resume `ckpt_path` with another architecture, optimizer or data stream (`stream_keys`),
    naming the keys and the fix (exit 78).

    Called before the run directory is written to, so a refused command leaves the run as it was. Without it a
    changed shape fails deep inside `load_state_dict` (exit 1, which `lm supervise` retries forever), and a
    change that keeps the shapes (`n_head`, `init_std`) would silently reinterpret the weights.
    """
    if ckpt_path is None or not ckpt_path.exists():
        return  # nothing to resume (or, on a rank other than 0, rank 0 is still repairing last.ckpt)
    ckpt = files.read_meta(ckpt_path)  # never the tensors: a sharded 70B folder is read per rank later
    # optim.name: AdamW's and Muon's states differ in groups and contents (checkpoints before it: AdamW).
    was = ckpt.get("hyper_parameters", {}).get("optim", {}).get("name", "adamw")
    if was != optimizer:
        raise Refused(
            f"{ckpt_path} (step {ckpt['global_step']}) was trained with optim={was}, this config has "
            f"optim={optimizer}: the optimizer state cannot carry over; set optim={was} to continue the run, or "
            f"start a new one with run.resume=false (the old run moves to archive/) or another run.name"
        )
    if data is not None:
        check_stream(ckpt_path, ckpt, data)
    saved = ckpt.get("hyper_parameters", {}).get("model")
    if saved is None:
        return
    before, now = architecture(ModelConfig(**saved)), architecture(model)
    changed = [f"{key}={before[key]} -> {now[key]}" for key in now if before[key] != now[key]]
    if changed:
        raise Refused(
            f"{ckpt_path} (step {ckpt['global_step']}) holds another model than this config: "
            f"{', '.join(changed)}. Weights and optimizer state cannot carry over; set the checkpoint's values "
            f"to continue the run, or start a new one with run.resume=false (the old run moves to archive/) "
            f"or another run.name"
        )


def check_stream(ckpt_path: Path, ckpt: dict[str, Any], data: DataConfig) -> None:
    """Refuse a changed `stream_keys` value (checkpoints from before they were recorded: nothing to compare)."""
    before = saved_settings(ckpt)
    now = stream_keys(data)
    changed = [
        f"{key}={before[key]} -> {now[key]}" for key in now if key in before and before[key] != now[key]
    ]
    if changed:
        raise Refused(
            f"{ckpt_path} (step {ckpt['global_step']}) was trained on another data stream: {', '.join(changed)}. "
            f"The resumed position (step x global batch windows) would name other tokens, so the run cannot "
            f"continue where it stopped; set the checkpoint's values to continue the run, or start a new run "
            f"from these weights (`lm export` this run, then model.init_from=<the export> with another "
            f"run.name)"
        )


def flat_settings(hparams: dict[str, Any]) -> dict[str, Any]:
    """{'model.n_layer': 2, 'optim.lr': 0.001, ...} from a checkpoint's hyper-parameters."""
    return {
        f"{section}.{key}": value
        for section in ("model", "optim")
        for key, value in hparams.get(section, {}).items()
    }


class ResumeCheck(pl.Callback):
    """At train start: every rank resumed the same step (else stop), the global batch is the checkpoint's
    (else warn), and each setting that differs from the checkpoint's is logged as applied.

    Each rank finds its checkpoint in its own view of `run.root`; a folder that only rank 0's node sees lets
    the other nodes start fresh beside a resumed rank 0 (DDP would copy rank 0's weights but not its optimizer,
    step or data position, and the ranks would reach max_steps at different times and hang). The data stream
    position is step x global batch, so resuming with another global batch (8 GPUs -> 4 without doubling
    data.batch_size) re-reads or skips windows; the meter's tokens per step tell.
    """

    def __init__(self, meter=None, consensus: Agreement | None = None) -> None:
        self.meter = meter
        self.consensus = consensus or Alone()
        """The run's agreement across ranks: every rank's resumed step, gathered."""
        self.previous: dict[str, Any] | None = None
        """The resumed checkpoint's settings (flattened hyper-parameters + RunState's `settings`); None on a
        fresh run."""

    @staticmethod
    def run_settings(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The settings a checkpoint's hyper-parameters do not hold, named as in the config."""
        return {
            "optim.total_steps (resolved)": pl_module.schedule_steps,  # trainer.max_steps when unset
            "trainer.gradient_clip_val": trainer.gradient_clip_val,
            **stream_settings(trainer),
        }

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        hparams = flat_settings(checkpoint.get("hyper_parameters", {}))
        self.previous = {**hparams, **saved_settings(checkpoint)}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = self.consensus.gather(trainer, trainer.global_step)  # every rank sees every rank's step
        if len(set(steps)) > 1:  # the same answer on every rank: all refuse together
            starts = ", ".join(f"rank {rank} at step {step}" for rank, step in enumerate(steps))
            raise Refused(
                f"the ranks start at different steps ({starts}): every node must see the same checkpoints. "
                "Put run.root on storage that all nodes share"
            )
        changed = []
        if trainer.is_global_zero and self.previous is not None:
            changed = self.log_changes(trainer, pl_module)
        m = self.meter
        if (
            m is not None
            and trainer.is_global_zero
            and GLOBAL_BATCH not in changed  # said with the change
            and RAMP not in changed
            and m.state.step
            and m.state.tokens != m.ramp.tokens_through(m.state.step)
        ):
            log.warning(
                "resuming at step %d with %d tokens a step, but %d tokens took %d steps so far (%.0f a step, "
                "%d expected with this batch and ramp): the data stream position is step x global batch, so "
                "windows are re-read or skipped. Keep devices x nodes x data.batch_size x accumulation as "
                "before to continue the stream exactly",
                m.state.step, m.tokens_per_step, m.state.tokens, m.state.step, m.state.tokens / m.state.step,
                m.ramp.tokens_through(m.state.step),
            )  # fmt: skip

    def log_changes(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[str]:
        """One log line per changed setting (old -> new at the resumed step, and what a data-stream change does
        to exact resume) and a table in TensorBoard's text tab, as at a phase change: the new values are what
        the run trains with from here on. Returns the changed keys."""
        now = {**flat_settings(pl_module.hparams), **self.run_settings(trainer, pl_module)}
        step = trainer.global_step
        changed = [
            (key, self.previous[key], value, effect(key, step))
            for key, value in now.items()
            if key in self.previous and self.previous[key] != value
        ]
        for key, old, new, what in changed:
            log.warning(
                "resumed at step %d with a changed setting, applied from here on: %s %r -> %r%s",
                step, key, old, new, f"; {what}" if what else "",
            )  # fmt: skip
        experiment = getattr(trainer.logger, "experiment", None)
        if changed and hasattr(experiment, "add_text"):
            rows = [f"| {key} | {old!r} | {new!r} | {what or '-'} |" for key, old, new, what in changed]
            header = ["| setting | was | now | exact resume |", "|---|---|---|---|"]
            table = "\n".join([f"Resumed at step {step} with:", "", *header, *rows])
            experiment.add_text("resume/changes", table, global_step=step)
        return [key for key, *_ in changed]
