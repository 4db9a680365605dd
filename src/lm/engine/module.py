"""LMModule: the Lightning wrapper around the decoder (loss, optimizer, schedule, logging)."""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lm.base.exits import Refused
from lm.base.private_api import set_last_lr
from lm.config import OptimConfig
from lm.data.bytes import token_byte_lengths
from lm.engine import fp8 as float8
from lm.engine import optim
from lm.engine.kernels import apply_liger, check_liger_model
from lm.engine.parallel import grad_norm, shard_model
from lm.model import ModelConfig, Transformer
from lm.numbers.batch_ramp import window_len_at
from lm.numbers.lr_schedule import lr_lambda

log = logging.getLogger(__name__)


def fused_linear_cross_entropy(
    hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against targets, computed chunk by chunk by Liger: the
    (N, V) logits tensor (2 GB in fp32 at 16K tokens x 32K vocabulary) is never materialised."""
    lf = importlib.import_module("liger_kernel.transformers.functional")
    return lf.liger_fused_linear_cross_entropy(hidden_ND, weight_VD, targets_N)


def eager_cross_entropy(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """The eager loss, in fp32 (a bf16 log-softmax over 32K classes loses the small probabilities)."""
    return F.cross_entropy(logits_NV.float(), targets_N)


class DeviceScalar:
    """A number logged at every step as one tensor kept on the module's device and refilled in place.

    `self.log(name, <python float>)` makes a new device tensor from a host number each call: on a GPU a
    host-to-device copy, which waits for the kernels queued so far, at every step (issue 54). `fill_` passes the
    number as a kernel argument instead: nothing is copied and the host does not wait. Lightning reads the value
    (a device-to-host copy) only when it writes the logs, every `trainer.log_every_n_steps` steps."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None

    def __call__(self, value: float, device: torch.device) -> torch.Tensor:
        if self.tensor is None or self.tensor.device != device:
            self.tensor = torch.zeros((), device=device)
        return self.tensor.fill_(value)


def short_windows(window_BT1: torch.Tensor, length: int) -> torch.Tensor:
    """Each window of T+1 tokens cut into T/length windows of length+1 (`data.seq_len_warmup_steps`): piece j
    is tokens j·length .. (j+1)·length, so the pieces predict exactly the T targets of the window, each from
    the context inside its piece only. A view of the batch when length == T."""
    B, T = window_BT1.shape[0], window_BT1.shape[1] - 1
    if length == T:
        return window_BT1
    return window_BT1.unfold(1, length + 1, length).reshape(B * (T // length), length + 1)


def z_loss(logits_NV: torch.Tensor, coef: float) -> torch.Tensor:
    """coef * mean(logsumexp(logits)^2) (PaLM): pulls the softmax normaliser towards 1 so the logits cannot
    drift up together. In fp32; the padding ids' -inf logits add nothing to the logsumexp."""
    return coef * torch.logsumexp(logits_NV.float(), dim=-1).square().mean()


class LMModule(pl.LightningModule):
    """Next-token prediction with AdamW, or Muon and AdamW (lm.engine.optim).

    `model` and `optim` are saved as plain dicts in every checkpoint's hyper-parameters, so
    `LMModule.load_from_checkpoint(path)` rebuilds the architecture without the config tree.
    Activation checkpointing, compilation, Liger kernels and FP8 matmuls are runtime choices, not
    hyper-parameters: a run may change them between phases without touching its weights (Liger and torchao's
    Float8Linear keep the eager state-dict keys and fp32 weights).
    """

    def __init__(
        self,
        model: ModelConfig | dict[str, Any],
        optim: OptimConfig | dict[str, Any],
        *,
        total_steps: int | None = None,
        ac_every: int = 0,
        compile: bool = False,
        compile_mode: str | None = None,
        liger: bool = False,
        fp8: str | None = None,
        fp8_emulate: bool = False,
        eot_id: int | None = None,
        window_stages: tuple[tuple[int, int], ...] | None = None,
        lr_cooldown: Callable[[], tuple[int, int] | None] | None = None,
        decide_stride: Callable[[], Any] | None = None,
        from_rank0: Callable[[pl.Trainer, Any], Any] | None = None,
    ) -> None:
        super().__init__()
        self.model_cfg = model if isinstance(model, ModelConfig) else ModelConfig(**model)
        self.optim_cfg = optim if isinstance(optim, OptimConfig) else OptimConfig(**optim)
        self.lr_scalar = DeviceScalar()  # train/lr, logged at every step without a host-to-device copy
        self.save_hyperparameters({"model": asdict(self.model_cfg), "optim": asdict(self.optim_cfg)})
        self.total_steps = total_steps or self.optim_cfg.total_steps
        self.compile_model, self.compile_mode = compile, compile_mode
        self.model = Transformer(self.model_cfg)
        self.model.ac_every = ac_every
        self.decide_stride = decide_stride
        """`activation_checkpointing=auto` on a GPU: the probe rank 0 runs at setup (None: `ac_every` is it)."""
        self.from_rank0 = from_rank0
        """Rank 0's value on every rank: the run's `Consensus.from_rank0` (the ranks' one agreement; None: one
        process, where the value is the answer)."""
        self.stride: Any = None
        """The `lm.engine.activation_checkpointing.Decision` taken at setup, once `decide_stride` has run (what
        the cost meter records); not imported here: that module trains an LMModule in its trial steps."""
        self.model.eot_id = eot_id  # model.doc_mask's document boundary; setup() takes the data's
        self.window_stages = window_stages
        """`data.seq_len_warmup_steps`' (first step, window length) stages, a function of the global step
        (so a resumed run cuts its windows as the uninterrupted one did); None: full windows throughout."""
        self.liger = liger
        if liger:
            check_liger_model(self.model_cfg)  # the doctor refused it already (exit 78); here for lm bench
            apply_liger(self.model)
        if fp8:  # after Liger, which calls the same linear modules; before compile and FSDP sharding
            float8.convert(self.model, fp8, fp8_emulate)
        self.lr_cooldown = lr_cooldown or (lambda: None)
        """(start step, length) of an early stop's LR cooldown, or None: read from the run's RunState, where
        the stopper records it (None for a module without a run, e.g. a bench)."""
        self._norm_cache: tuple[int, torch.Tensor | None] | None = None
        self._sharded = False
        self.compiled = False
        """Whether `configure_model` compiled the model in place (once: Lightning may call it again)."""
        self.register_buffer("token_bytes", None, persistent=False)
        """(padded vocab,) UTF-8 bytes per token id, for `val/bpb`; set at setup from the data's tokenizer."""

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # trainer.strategy=fsdp: shard (and compile) block by block
            if not self._sharded:
                precision = str(self.trainer.precision)
                mesh = self.device_mesh["data_parallel"]
                shard_model(
                    self.model,
                    mesh,
                    precision=precision,
                    compile=self.compile_model,
                    compile_mode=self.compile_mode,
                )
                self._sharded = True
            return
        # Module.compile() compiles in place: state_dict keys stay free of `_orig_mod.` prefixes, so
        # checkpoints load the same whether or not the run that wrote them compiled.
        if self.compile_model and not self.compiled:
            self.model.compile(mode=self.compile_mode)
            self.compiled = True

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.model(idx_BT)

    def loss(self, window_BT1: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over a batch of windows of T+1 tokens."""
        return self.loss_terms(window_BT1, z_coef=0.0)[0]

    def loss_terms(self, window_BT1: torch.Tensor, z_coef: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean next-token cross-entropy, the z-loss term or None when `z_coef` is 0)."""
        inputs, targets = window_BT1[:, :-1], window_BT1[:, 1:]
        if self.model_cfg.doc_mask and self.model.eot_id is None:
            raise Refused(
                "model.doc_mask=true needs the end-of-text id that separates documents: train with a data "
                "module that has `eot_id` (lm's do), or pass LMModule(eot_id=...); or set model.doc_mask=false"
            )
        if self.liger:  # Liger's fused head + loss: the (B, T, V) logits are never materialised
            hidden_BTD = self.model.hidden(inputs)
            # Liger takes no logit mask: the head cut to the real vocabulary is the loss of the masked logits.
            weight_VD = self.model.lm_head.weight[: self.model_cfg.vocab_size]
            ce = fused_linear_cross_entropy(hidden_BTD.flatten(0, 1), weight_VD, targets.flatten())
            return ce, None  # check_liger_model refuses a z-loss: these logits are never materialised
        logits_NV = self.model(inputs).flatten(0, 1).float()  # one fp32 copy for both terms
        ce = eager_cross_entropy(logits_NV, targets.flatten())
        return ce, (z_loss(logits_NV, z_coef) if z_coef else None)

    def objective(self, window_BT1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(what training back-propagates: the cross-entropy plus `model.z_loss`'s term, the cross-entropy,
        the z-loss term or None): the training step's, and activation_checkpointing=auto's trial steps'."""
        if not self.model_cfg.z_loss:  # through `loss`, the one entry point (fault injection wraps it too)
            ce = self.loss(window_BT1)
            return ce, ce, None
        ce, z_term = self.loss_terms(window_BT1, self.model_cfg.z_loss)
        return ce + z_term, ce, z_term

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.window_stages is not None:
            batch = short_windows(batch, window_len_at(self.window_stages, self.trainer.global_step))
        loss, ce, z_term = self.objective(batch)
        # Logger-only: it stays on the device until a logging step. A prog_bar metric would be copied to the
        # host (a device sync) at every batch end; lm's LossProgressBar reads it at logging steps instead.
        # The global batch's loss: the mean over ranks (one scalar all-reduce; a no-op on one device).
        # train/loss stays the cross-entropy, comparable with val/loss and across runs with and without a z-loss.
        self.log("train/loss", ce, sync_dist=True)
        if z_term is not None:
            self.log("train/z_loss", z_term, sync_dist=True)
        return loss

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.decide_stride is not None and self.stride is None:
            self.decide_activation_checkpointing()
        datamodule = getattr(self.trainer, "datamodule", None)
        if self.model_cfg.doc_mask and hasattr(datamodule, "eot_id"):  # the manifest's, after prepare_data
            self.model.eot_id = datamodule.eot_id
        tokenizer = getattr(datamodule, "tokenizer", None)
        if tokenizer is not None:  # buffers follow the module to its device; not saved in checkpoints
            self.token_bytes = token_byte_lengths(tokenizer, self.model_cfg.padded_vocab_size)

    def decide_activation_checkpointing(self) -> None:
        """Rank 0 probes (`decide_stride`: trial steps against its GPU's free memory) and every rank trains with
        its stride: ranks whose GPUs had different free memory would otherwise recompute differently, and
        under FSDP run different collectives in the backward. Called in `setup`, once the process group is up
        and before `configure_model` (sharding, compilation) and before the model reaches the device."""
        trainer = self.trainer
        decision = self.decide_stride() if trainer.is_global_zero else None
        if self.from_rank0 is not None:
            decision = self.from_rank0(trainer, decision)
        elif trainer.world_size > 1:
            raise RuntimeError("activation_checkpointing=auto on several ranks needs the run's Consensus")
        self.stride = decision
        self.model.ac_every = self.stride.every
        log.info(
            "activation checkpointing %s (%s)%s",
            self.stride.label,
            self.stride.reason,
            f", decided by rank 0 for all {trainer.world_size} ranks" if trainer.world_size > 1 else "",
        )

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self.loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        val_source = getattr(self.trainer.datamodule, "val_source", None)
        source = val_source(batch_idx) if val_source else None
        if source is not None:  # a data mixture: each validation batch is one source's
            self.log(f"val/loss/{source}", loss, sync_dist=True)
        if self.token_bytes is not None:
            targets = batch[:, 1:]
            self._val_nats += loss.detach().double() * targets.numel()
            self._val_bytes += self.token_bytes[targets].sum()

    def on_validation_epoch_start(self) -> None:
        self._val_nats = torch.zeros((), dtype=torch.float64, device=self.device)
        self._val_bytes = torch.zeros((), dtype=torch.int64, device=self.device)

    def on_validation_epoch_end(self) -> None:
        """`val/bpb`: the nats of every validated token over the bytes of text they spell, summed over all
        windows and ranks before dividing (a mean of per-batch ratios would weigh short texts up)."""
        if self.token_bytes is None:
            return
        nats = self.trainer.strategy.reduce(self._val_nats, reduce_op="sum")
        n_bytes = self.trainer.strategy.reduce(self._val_bytes, reduce_op="sum").clamp_min(1)
        self.log("val/bpb", (nats / math.log(2) / n_bytes).float())

    def gradient_norm(self) -> torch.Tensor | None:
        """The global pre-clip gradient norm of this optimizer step, computed once and shared by the
        non-finite guard, the `train/grad_norm` log and clipping (each would otherwise read every gradient)."""
        step = self.trainer.global_step
        if self._norm_cache is None or self._norm_cache[0] != step:
            self._norm_cache = (step, grad_norm(self.parameters()))
        return self._norm_cache[1]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Called after AMP unscaling and before clipping: this is the true pre-clip norm.
        norm = self.gradient_norm()
        if norm is not None:
            self.log("train/grad_norm", norm)
        self.log("train/lr", self.lr_scalar(optimizer.param_groups[0]["lr"], self.device))

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by the global norm already computed for this step (Lightning's default would compute it again)."""
        if not gradient_clip_val or gradient_clip_algorithm not in (None, "norm"):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        # FSDP2 shards (DTensor gradients) scale by the same plain global norm, as torchtitan clips them.
        # Lightning's own path is no fallback: under mixed precision it refuses a fused AdamW.
        params = [p for p in self.parameters() if p.grad is not None]
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, self.gradient_norm())
        return None

    @property
    def schedule_steps(self) -> int:
        """Steps the LR schedule spans: `optim.total_steps`, else this invocation's `trainer.max_steps`."""
        total_steps = self.total_steps or self.trainer.max_steps
        if total_steps is None or total_steps < 1:
            raise Refused(
                "the LR schedule needs optim.total_steps or trainer.max_steps to be a positive step count"
            )
        return total_steps

    def group_settings(self) -> list[dict[str, Any]]:
        """Each optimizer group's settings from `optim` (lm.engine.optim.group_settings) on this device: what a fresh
        run is built with and what a resumed one sets over the restored optimizer (`apply_optim_config`)."""
        cfg = self.optim_cfg
        return optim.group_settings(cfg, cfg.fused if cfg.fused is not None else self.device.type == "cuda")

    def configure_optimizers(self) -> dict[str, Any]:
        total_steps = self.schedule_steps
        fused = self.group_settings()[-1]["fused"]  # the last group is AdamW's under either optimizer
        optimizer = optim.build(self.model, self.optim_cfg, fused)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(self.optim_cfg, total_steps, self.lr_cooldown)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        if self.trainer.ckpt_path is not None:
            self.apply_optim_config()

    def apply_optim_config(self) -> None:
        """Set the restored optimizer and LR schedule to this run's `optim`, at the restored step.

        Lightning restores AdamW's param_groups (lr, betas, eps, weight_decay, fused) and the scheduler's base
        LRs from the checkpoint: without this a resumed run trains with the old values while config.yaml and
        the next checkpoint record the new ones. Every `optim` key may change mid-run (a phase may change
        them): the moments keep their shapes, and the schedule is a pure function of the step, so the LR is
        recomputed from the new config at the restored step. An unchanged config sets the same values again.
        `ResumeCheck` logs what changed.
        """
        optimizer = self.trainer.optimizers[0]
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        for group, settings in zip(optimizer.param_groups, self.group_settings(), strict=True):
            if "fused" in settings and bool(group.get("fused")) != settings["fused"]:  # AdamW's groups
                place_steps(optimizer, group["params"], settings["fused"])
            group.update(settings, initial_lr=settings["lr"])
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        for group, base_lr, multiplier in zip(
            optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base_lr * multiplier(scheduler.last_epoch)  # LambdaLR's own formula
        set_last_lr(
            scheduler, [group["lr"] for group in optimizer.param_groups]
        )  # what get_last_lr() reports


def place_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], fused: bool) -> None:
    """Move AdamW's `step` counters where the kernel now in use expects them: on the parameter's device for
    the fused kernel, on the CPU otherwise (torch's own load_state_dict policy). A CPU checkpoint resumed on a
    GPU switches kernels."""
    for p in params:
        state = optimizer.state.get(p, {})
        if "step" in state:
            state["step"] = state["step"].to(dtype=torch.float32, device=p.device if fused else "cpu")
