"""What a config turns into on this machine: the device, precision, compilation, fused AdamW and the price.

One `resolve(cfg)` serves training, `lm bench` and the doctor alike, so the three never disagree on what
`precision=auto` or `kernels=auto` means; `lm doctor gpu=a100_80gb` on a laptop resolves for a GPU that is not
here (`plan_gpu`) by the same rules. Impossible choices (fp16 on a CPU, bf16 on a GPU without it, Liger
without CUDA) are refused here, before any data is prepared or a model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lm.config import GpuConfig, LMConfig, TrainerConfig, conf_dir
from lm.engine.kernels import check_liger
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
    gpu: GpuConfig
    """Catalog entry of the device (`cpu` on a CPU, an empty `unknown` for an uncatalogued GPU)."""
    device_name: str
    """What the device calls itself."""
    price: float | None
    """$/hour per device the run is metered at (cost.price_per_hour or the catalog; None: unknown)."""


def uses_cuda(trainer: TrainerConfig) -> bool:
    """Whether this run will train on an NVIDIA GPU of this machine."""
    return trainer.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def resolve_precision(mode: str, cuda: bool, bf16: bool) -> str:
    """`auto` becomes the fastest precision that is numerically safe on the device (`bf16`: it has bf16)."""
    if mode == "16-mixed" and not cuda:
        raise ValueError(
            "precision=fp16 (16-mixed) needs a CUDA GPU; on a CPU use precision=auto, bf16 or fp32"
        )
    if mode.startswith("bf16") and cuda and not bf16:
        raise ValueError(
            f"precision {mode} needs a GPU with bf16 (Ampere or newer); this one has none: use precision=fp16"
        )
    if mode != "auto":
        return mode
    if not cuda:
        return "32-true"
    return "bf16-mixed" if bf16 else "16-mixed"


def planning_gpu(cfg: LMConfig) -> GpuConfig | None:
    """The catalog GPU `lm doctor` plans for on a machine without one: `gpu=<entry>` named on the command
    line and an accelerator that is not `cpu`; None when this machine's own device is what counts."""
    if uses_cuda(cfg.trainer) or cfg.trainer.accelerator == "cpu":
        return None
    return cfg.gpu if cfg.gpu.name not in ("auto", "cpu", "unknown") else None


def resolve(cfg: LMConfig, plan_gpu: GpuConfig | None = None) -> Runtime:
    """`cfg` on this machine's device, or on `plan_gpu` when this machine has no GPU to train on."""
    cuda = uses_cuda(cfg.trainer)
    planned = plan_gpu is not None and not cuda
    if cuda:
        device = cost.resolve_gpu(cfg.gpu, torch.cuda.get_device_name(), conf_dir())
        bf16 = torch.cuda.is_bf16_supported()
    elif planned:
        device, cuda = cost.Device(plan_gpu, plan_gpu.name), True
        bf16 = plan_gpu.peak_bf16_tflops is not None  # every catalogued GPU with a bf16 peak supports it
    else:
        device, bf16 = cost.resolve_gpu(cfg.gpu, None, conf_dir()), False
    precision = resolve_precision(cfg.precision.mode, cuda, bf16)
    if not planned:  # a planned GPU's machine will have its own Liger install: nothing to import here
        check_liger(cfg.kernels.liger, cuda)
    return Runtime(
        cuda=cuda,
        planned=planned,
        precision=precision,
        compile=cfg.kernels.compile if cfg.kernels.compile is not None else cuda,
        fused_adamw=cfg.optim.fused if cfg.optim.fused is not None else cuda,
        gpu=device.gpu,
        device_name=device.device_name,
        price=cost.price_per_hour(device.gpu, cfg.cost),
    )


def set_matmul_precision(tf32: bool) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions (Ampere and newer; a no-op on a CPU)."""
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32
