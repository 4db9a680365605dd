"""What a config turns into on this machine: the device, precision, compilation, fused AdamW and the price.

One `resolve(...)` (the config's trainer, gpu, precision, kernels, optim and cost sections) serves training, `lm bench` and the doctor alike, so the three never disagree on what
`precision=auto` or `kernels=auto` means; `lm doctor gpu=a100_80gb` on a laptop resolves for a GPU that is not
here (`plan_gpu`) by the same rules. Impossible choices (fp16 on a CPU, bf16 on a GPU without it, Liger
without CUDA) are refused here, before any data is prepared or a model is built.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import torch

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.config import (
    CostConfig,
    GpuConfig,
    KernelsConfig,
    LMConfig,
    OptimConfig,
    PrecisionConfig,
    TrainerConfig,
    conf_dir,
)
from lm.engine.fp8 import check_fp8
from lm.engine.kernels import check_liger, check_liger_model
from lm.numbers import cost


@dataclass
class Runtime:
    """A config resolved for a device."""

    cuda: bool
    """Training on an NVIDIA GPU, or planning for one (`planned`)."""
    planned: bool
    """The GPU is not on this machine: `lm doctor gpu=<entry>` checks a run for it."""
    precision: str
    """Lightning precision, never `auto`."""
    compile: bool
    fused_adamw: bool
    fp8: str | None
    """torchao's FP8 recipe for the blocks' linear layers (`tensorwise`, `rowwise`), or None."""
    gpu: GpuConfig
    """Catalog entry of the device (`cpu` on a CPU, an empty `unknown` for an uncatalogued GPU)."""
    device_name: str
    """What the device calls itself."""
    price: float | None
    """$/hour per device the run is metered at (cost.price_per_hour or the catalog; None: unknown)."""

    @property
    def precision_label(self) -> str:
        """The precision as the log and bench.json name it: `bf16-mixed`, `bf16-mixed+fp8-tensorwise`."""
        return f"{self.precision}+fp8-{self.fp8}" if self.fp8 else self.precision


def uses_cuda(trainer: TrainerConfig) -> bool:
    """Whether this run will train on an NVIDIA GPU of this machine."""
    return trainer.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def resolve_precision(mode: str, cuda: bool, bf16: bool) -> str:
    """`auto` becomes the fastest precision that is numerically safe on the device (`bf16`: it has bf16)."""
    if mode == "16-mixed" and not cuda:
        raise Refused("precision=fp16 (16-mixed) needs a CUDA GPU; on a CPU use precision=auto, bf16 or fp32")
    if mode.startswith("bf16") and cuda and not bf16:
        raise Refused(
            f"precision {mode} needs a GPU with bf16 (Ampere or newer); this one has none: use precision=fp16"
        )
    if mode != "auto":
        return mode
    if not cuda:
        return "32-true"
    return "bf16-mixed" if bf16 else "16-mixed"


def planning_gpu(trainer: TrainerConfig, gpu: GpuConfig) -> GpuConfig | None:
    """The catalog GPU `lm doctor` plans for on a machine without one: `gpu=<entry>` named on the command
    line and an accelerator that is not `cpu`; None when this machine's own device is what counts."""
    if uses_cuda(trainer) or trainer.accelerator == "cpu":
        return None
    return gpu if gpu.name not in ("auto", "cpu", "unknown") else None


def resolve(
    trainer: TrainerConfig,
    gpu: GpuConfig,
    precision: PrecisionConfig,
    kernels: KernelsConfig,
    optim: OptimConfig,
    cost_cfg: CostConfig,
    plan_gpu: GpuConfig | None = None,
) -> Runtime:
    """The run on this machine's device, or on `plan_gpu` when this machine has no GPU to train on."""
    cuda = uses_cuda(trainer)
    planned = plan_gpu is not None and not cuda
    if cuda:
        device = cost.resolve_gpu(gpu, torch.cuda.get_device_name(), conf_dir())
        bf16 = torch.cuda.is_bf16_supported()
    elif planned:
        device, cuda = cost.Device(plan_gpu, plan_gpu.name), True
        bf16 = plan_gpu.peak_bf16_tflops is not None  # every catalogued GPU with a bf16 peak supports it
    else:
        device, bf16 = cost.resolve_gpu(gpu, None, conf_dir()), False
    resolved = resolve_precision(precision.mode, cuda, bf16)
    compile = kernels.compile if kernels.compile is not None else cuda
    if not planned:  # a planned GPU's machine will have its own Liger install: nothing to import here
        check_liger(kernels.liger, cuda)
    check_fp8(precision.fp8, precision.fp8_emulate, cuda, planned, device.gpu, compile)
    return Runtime(
        cuda=cuda,
        planned=planned,
        precision=resolved,
        compile=compile,
        fused_adamw=optim.fused if optim.fused is not None else cuda,
        fp8=precision.fp8,
        gpu=device.gpu,
        device_name=device.device_name,
        price=cost.price_per_hour(device.gpu, cost_cfg),
    )


LIGHTNING_RANK_ZERO_LOG = "lightning.pytorch.utilities.rank_zero"
"""The logger Lightning's `rank_zero_info` writes through (lightning_utilities' `rank_zero_module.log`)."""


def resolve_runtime(cfg: LMConfig, plan_gpu: GpuConfig | None = None) -> Runtime:
    """`resolve` with this config's sections."""
    if cfg.kernels.liger:  # before any data or model: a recipe lever Liger cannot serve is exit 78
        check_liger_model(cfg.model)
    return resolve(cfg.trainer, cfg.gpu, cfg.precision, cfg.kernels, cfg.optim, cfg.cost, plan_gpu)


def hide_litlogger_tip(record: logging.LogRecord) -> bool:
    """False for the litlogger advertisement Lightning logs from every Trainer without a LitLogger, which no
    run of lm uses; it has no switch of its own (lightning 2.6's LoggerConnector.configure_logger)."""
    return "litlogger" not in record.getMessage()


LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
"""Loggers Lightning gives console handlers of their own at import (`lightning`'s "INFO: ..." one always)."""
HARMLESS_WARNINGS = (
    # lightning 2.6's _pytree asks torch >= 2.10 about LeafSpec the deprecated way, at every fit; nothing to act on.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)


def quiet_lightning() -> None:
    """One line per log record, without third-party noise nobody can act on; idempotent.

    Where the process has a root handler (Hydra's, with time and logger name, writing the invocation's log
    file too), Lightning's records go through it alone: `lightning`'s own "INFO: ..." console handler printed
    each of them a second time (the doctor's table, "Seed set", "GPU available"), and a Lightning imported
    before Hydra configured logging kept its records out of the log file. Also: the litlogger advertisement,
    the known-harmless warnings above, and TensorBoard's event reader, which logs every file it opens (the
    report reads the run's events at the end)."""
    logger = logging.getLogger(LIGHTNING_RANK_ZERO_LOG)
    if hide_litlogger_tip not in logger.filters:
        logger.addFilter(hide_litlogger_tip)
    if logging.getLogger().handlers:
        for name in LIGHTNING_LOGGERS:
            own = logging.getLogger(name)
            for handler in [h for h in own.handlers if type(h) is logging.StreamHandler]:
                own.removeHandler(handler)
            own.propagate = True
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("tensorboard").setLevel(logging.WARNING)


def set_matmul_precision(tf32: bool) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions (Ampere and newer; a no-op on a CPU)."""
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32


# -- preflight: the doctor's precision and compile checks (lm.run.doctor runs them) -----------------------


def precision_findings(cuda: bool, precision: str, gpu: GpuConfig, tf32: bool) -> list[Finding]:
    """fp32 on a GPU; TF32 off. GPU advice only: a CPU smoke test is not worth nagging about."""
    if not cuda:
        return []
    out = []
    if precision == "32-true":
        ratio = (gpu.peak_bf16_tflops or 0) / (gpu.peak_tf32_tflops or math.inf)
        out.append(
            Finding(
                "precision",
                "warn",
                "fp32 training on a GPU (precision 32-true)",
                f"~2x+ tokens/s, half the activation memory (bf16 peak {ratio:.1f}x TF32's here; "
                "seed 001: 2-8x over fp32)",
                "precision=bf16",
            )
        )
    else:
        out.append(Finding("precision", "ok", precision))
    if not tf32:
        big = precision == "32-true"
        out.append(
            Finding(
                "tf32",
                "warn",
                "TF32 matmuls are off",
                "up to ~8x on fp32 matmuls (A100: 156 vs 19.5 TFLOP/s)"
                if big
                else "small (fp32 matmuls outside autocast); free (seed 000)",
                "precision.tf32=true",
            )
        )
    return out


def compile_findings(cuda: bool, kernels: KernelsConfig) -> list[Finding]:
    """torch.compile off on a GPU; Liger beside compile, which measured slower than compile alone (the
    gains quoted are `lm bench` on an H100, in docs/planning.md). Liger's remaining gain is memory (no logits
    tensor), so the Liger + compile warning says to keep it only where compile alone does not fit."""
    if not cuda:
        return []
    liger = kernels.liger
    if kernels.compile is False:
        gain = (
            "+12% tokens/s over Liger alone (1b on an H100: 65.3K -> 73.4K)"
            if liger
            else "+55% tokens/s, 20% less memory (1b on an H100: 47.3K -> 73.4K tok/s, 58 -> 46 GB)"
        )
        return [Finding("compile", "warn", "torch.compile is off on a GPU", gain, "kernels=compile")]
    if liger:
        return [
            Finding(
                "compile",
                "warn",
                "Liger kernels beside torch.compile: slower than compile alone where measured",
                "+13% tokens/s (1b on an H100: 65.0K -> 73.4K); keep Liger only if compile alone does not "
                "fit: lm bench kernels=compile,liger_compile",
                "kernels=compile",
            )
        ]
    return [Finding("compile", "ok", "torch.compile on")]
