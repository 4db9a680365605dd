"""FP8 training: the blocks' linear layers run their matmuls in float8 through torchao (the library torchtitan
uses), scaled per tensor (`tensorwise`, the faster) or per row (`rowwise`, closer to bf16).

`check_fp8` refuses what cannot pay before any data is prepared: no FP8 tensor cores (compute capability below
8.9), no torch.compile (eager FP8 is slower than bf16), or no torchao. `convert` swaps the chosen `nn.Linear`s
for torchao's `Float8Linear` in place with the same parameters, precision and state-dict keys, so an FP8
checkpoint resumes bitwise, loads into a bf16 run and exports as any other. The embedding and lm_head stay in
high precision (as torchtitan and OLMo-core keep the output layer: the logits' small differences are the
loss), and so do linear layers whose sides are not multiples of 16 (what `torch._scaled_mm` needs)."""

from __future__ import annotations

import dataclasses
import importlib

import torch
from torch import nn

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.config import FP8_RECIPES, GpuConfig

MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer."""
KEEP = ("lm_head",)
"""Linear layers that stay in high precision (module names)."""
INSTALL = "pip install torchao (or pip install -e '.[gpu]')"


def check_fp8(
    recipe: str | None, emulate: bool, cuda: bool, planned: bool, gpu: GpuConfig, compile: bool
) -> None:
    """Refuse `precision.fp8` where it cannot run or cannot pay, naming the device and the fix."""
    if recipe is None:
        return
    if recipe not in FP8_RECIPES:
        raise Refused(f"precision.fp8='{recipe}' is unknown; use one of {', '.join(FP8_RECIPES)}")
    if not emulate:
        check_device(cuda, planned, gpu)
        if not compile:
            raise Refused(
                "precision.fp8 without torch.compile is slower than bf16 (the casts run as separate kernels: "
                "nanochat measured 0.23x); use kernels=compile, or precision=bf16"
            )
    try:
        importlib.import_module("torchao.float8")
    except ImportError as e:
        raise Refused(f"precision.fp8 needs torchao ({e}): {INSTALL}") from e


def check_device(cuda: bool, planned: bool, gpu: GpuConfig) -> None:
    """FP8 tensor cores on this machine's GPU, or in the catalog entry of the GPU planned for."""
    if not cuda:
        raise Refused(
            "precision.fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: L40S, H100, "
            "H200, B200); this run is on a CPU: use precision=auto (precision.fp8_emulate=true only tests "
            "the FP8 code path, slowly)"
        )
    if planned:
        if gpu.peak_fp8_tflops is None:
            raise Refused(
                f"precision.fp8: the catalog's {gpu.name} has no FP8 tensor cores (conf/gpu/{gpu.name}.yaml "
                "peak_fp8_tflops is null); use precision=bf16"
            )
        return
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise Refused(
            f"precision.fp8 needs FP8 tensor cores (compute capability 8.9+); this "
            f"{torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}: use precision=bf16"
        )


def float8_config(recipe: str, emulate: bool):
    """torchao's recipe by name, emulated where asked."""
    from torchao.float8 import Float8LinearConfig  # deferred: torchao is an optional extra

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=True) if emulate else config


def convertible(module: nn.Module, name: str) -> bool:
    """A linear layer FP8 serves: not kept in high precision, both sides multiples of 16."""
    return (
        isinstance(module, nn.Linear)
        and name.split(".")[-1] not in KEEP
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert(model: nn.Module, recipe: str, emulate: bool = False) -> list[str]:
    """Swap the model's convertible linear layers for torchao's Float8Linear in place; their names."""
    from torchao.float8 import convert_to_float8_training  # deferred: torchao is an optional extra

    converted: list[str] = []

    def take(module: nn.Module, name: str) -> bool:
        if convertible(module, name):
            converted.append(name)
            return True
        return False

    convert_to_float8_training(model, config=float8_config(recipe, emulate), module_filter_fn=take)
    return converted


def describe(model: nn.Module) -> str:
    """How many of the model's linear layers compute in FP8, for the run's log and the doctor."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    fp8 = [m for m in linears if type(m).__name__ == "Float8Linear"]
    return f"{len(fp8)} of {len(linears)} linear layers in FP8 ({', '.join(KEEP)} kept in high precision)"


def fp8_findings(recipe: str | None, emulate: bool, cuda: bool) -> list[Finding]:
    """FP8 chosen (and how); emulation outside a test is a mistake worth naming."""
    if recipe is None:
        return []
    if emulate and cuda:
        return [
            Finding(
                "fp8",
                "warn",
                "precision.fp8_emulate=true on a GPU: FP8 is emulated, far slower than bf16",
                "the FP8 tensor cores' speed",
                "precision.fp8_emulate=false",
            )
        ]
    return [Finding("fp8", "ok", f"FP8 {recipe}" + (" (emulated)" if emulate else ""))]
