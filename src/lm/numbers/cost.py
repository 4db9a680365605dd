"""GPU catalog math: FLOPs per token, MFU, dollars per token, Chinchilla budgets.

FLOPs per token (torchtitan's convention, no causal discount):
    6 * N + 12 * n_layer * d_model * seq_len
where N is the parameter count without the input embedding table (a lookup, not a matmul). MFU is
tokens/s x FLOPs per token / (peak FLOP/s x GPUs), against the dense tensor-core peak of the run's precision.
The recipe levers (lm.model) change N where they change the matrices: `model.mlp=relu2` at its default width
(3/2 SwiGLU's, two matrices instead of three) has SwiGLU's N and so its FLOPs; `model.qk_norm` adds its gains
(2 x head_dim per block). Their other work is elementwise (the q/k norms, the softcap's tanh over V logits, the
z-loss's logsumexp), which this count leaves out as it leaves out RMSNorm and the softmax.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.config import CostConfig, DoctorConfig, GpuConfig
from lm.model import ModelConfig, Transformer
from lm.numbers.memory import Workload

log = logging.getLogger(__name__)

FLOPS_FORMULA = "6*N_non_embedding + 12*n_layer*d_model*seq_len FLOPs/token (no causal discount)"

ASSUMED_MFU: float = DoctorConfig.assumed_mfu
"""MFU assumed where none was measured on a GPU: the default of `doctor.assumed_mfu`, which holds the number
and the evidence for it (lm.config.DoctorConfig), read here so `lm sky` and the doctor cannot disagree."""


def non_embedding_params(cfg: ModelConfig) -> int:
    """N of the FLOPs formula, counted on the meta device (no memory allocated)."""
    with torch.device("meta"):
        return Transformer(cfg).num_parameters(exclude_embedding=True)


def flops_per_token(cfg: ModelConfig, seq_len: int, n_params: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token; see the module docstring for the formula."""
    n = non_embedding_params(cfg) if n_params is None else n_params
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * seq_len


def peak_flops(gpu: GpuConfig, precision: str, tf32: bool, fp8: bool = False) -> float | None:
    """Dense peak FLOP/s per device for the run's precision, or None when the catalog does not know it.

    An FP8 run's MFU is against the FP8 peak (2x bf16's on every FP8 tensor core): its matmuls could go that
    fast, so a run at 1.2x bf16's tokens/s shows 0.6x its MFU, not a flattering 1.2x."""
    if fp8:
        tflops = gpu.peak_fp8_tflops
    elif precision.startswith(("bf16", "16")):
        tflops = gpu.peak_bf16_tflops
    elif tf32:
        tflops = gpu.peak_tf32_tflops
    else:
        tflops = None  # plain fp32 CUDA-core peaks are not catalogued: no MFU rather than a guess
    return tflops * 1e12 if tflops else None


def fp8_peak_ratio(gpu: GpuConfig) -> float:
    """The GPU's FP8 peak over its bf16 peak (2 on every FP8 tensor core; 1 where either is unknown)."""
    if gpu.peak_fp8_tflops and gpu.peak_bf16_tflops:
        return gpu.peak_fp8_tflops / gpu.peak_bf16_tflops
    return 1.0


def mfu(tokens_per_sec: float, flops_per_tok: float, peak: float | None, n_devices: int) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None without a known peak."""
    if not peak:
        return None
    return tokens_per_sec * flops_per_tok / (peak * n_devices)


def catalog_prices(gpu: GpuConfig) -> dict[str, float]:
    """Every price the catalog records for `gpu`, by pricing (`on_demand`, `spot`)."""
    prices = {"on_demand": gpu.price_on_demand, "spot": gpu.price_spot}
    return {k: v for k, v in prices.items() if v is not None}


def catalog_price(gpu: GpuConfig, pricing: str, strict: bool = False) -> tuple[float, str] | None:
    """$/hour per GPU at `pricing`, and the pricing that price really is; the one policy for every caller.

    The catalog's `pricing` price when it has one. Where it has no spot price, comparisons (the doctor's
    $/token, `lm sky`'s ranking) take the on-demand price, labelled `on_demand`: an upper bound on spot, so a
    GPU is never ranked cheaper than it is. A run's meter passes `strict=True` and is refused instead, since
    metering a spot run at the on-demand rate would overstate every dollar figure without a word. None when
    the catalog has no price at all (an uncatalogued GPU, the CPU entry).
    """
    prices = catalog_prices(gpu)
    if pricing in prices:
        return prices[pricing], pricing
    if strict and prices:
        other = "on_demand" if pricing == "spot" else "spot"
        raise Refused(
            f"the catalog has no {pricing} price for gpu={gpu.name}; set cost.price_per_hour=<$/h per GPU> "
            f"or cost.pricing={other}"
        )
    if pricing == "spot" and "on_demand" in prices:
        return prices["on_demand"], "on_demand"
    return None


def price_per_hour(gpu: GpuConfig, cost: CostConfig) -> float | None:
    """$/hour per device a run is metered at: `cost.price_per_hour`, else the catalog's price for
    `cost.pricing` (strict: a missing spot price is refused, see `catalog_price`).

    None for a GPU without any catalogued price (the run is metered in seconds, not dollars, and was warned).
    """
    if cost.price_per_hour is not None:
        return cost.price_per_hour
    if gpu.name == "unknown":
        return None
    found = catalog_price(gpu, cost.pricing, strict=True)
    return found[0] if found else None


def usd(seconds: float, price: float, n_devices: int) -> float:
    """Money for `seconds` of wall clock on `n_devices` at `price` $/hour each."""
    return seconds * price * n_devices / 3600.0


def usd_per_billion_tokens(tokens_per_sec: float, price: float, n_devices: int) -> float | None:
    """$ per 10^9 tokens at a sustained throughput."""
    if tokens_per_sec <= 0:
        return None
    return price * n_devices / 3600.0 / tokens_per_sec * 1e9


def load_catalog(conf_dir: Path) -> dict[str, GpuConfig]:
    """Every catalogued GPU in `conf/gpu/` (all but `auto`), typed."""
    catalog = {}
    for path in sorted((conf_dir / "gpu").glob("*.yaml")):
        if path.stem == "auto":
            continue
        node = OmegaConf.merge(OmegaConf.structured(GpuConfig), OmegaConf.load(path))
        catalog[path.stem] = OmegaConf.to_object(node)
    return catalog


def detect(device_name: str, catalog: dict[str, GpuConfig]) -> GpuConfig | None:
    """The catalog entry whose `match` patterns fit a CUDA device name, or None."""
    hits = [g for g in catalog.values() if any(re.search(p, device_name) for p in g.match)]
    if len(hits) > 1:
        raise Refused(f"GPU '{device_name}' matches several catalog entries: {[g.name for g in hits]}")
    return hits[0] if hits else None


@dataclass
class Device:
    """The hardware a run is metered against."""

    gpu: GpuConfig
    """The catalog entry (or an empty `unknown` entry)."""
    device_name: str
    """What the device calls itself."""


def resolve_gpu(gpu: GpuConfig, device_name: str | None, conf_dir: Path) -> Device:
    """Turn `gpu=auto` into the catalog entry matching `device_name` (None: a CPU run); an unknown GPU gets
    an empty entry (no MFU, no price) and a warning."""
    name = device_name or "cpu"
    if gpu.name != "auto":
        return Device(gpu, name)
    catalog = load_catalog(conf_dir)
    if device_name is None:
        return Device(catalog["cpu"], name)
    found = detect(device_name, catalog)
    if found is None:
        log.warning(
            "GPU '%s' is not in the catalog: no MFU will be reported and $/h must be given with "
            "cost.price_per_hour; add conf/gpu/<name>.yaml with its dense peaks, prices and a `match` pattern",
            device_name,
        )
        return Device(GpuConfig(name="unknown"), name)
    return Device(found, name)


# -- preflight: the doctor's $/token check (lm.run.doctor runs it) ----------------------------------------

AC_SLOWDOWN = 1 / 1.18  # seed 000/002: checkpointing off took the A100 from 24.0K to 28.3K tokens/s (+18%)


def usd_per_btok(
    gpu: GpuConfig, work: Workload, fpt: float, mfu: float, pricing: str, tf32: bool
) -> tuple[float, str] | None:
    """Estimated $/10^9 tokens of this run on `gpu` (with checkpointing if it only fits that way), or None
    when the catalog lacks its price, peak or memory, or the run does not fit it. A GPU without a spot price
    is priced on demand (`catalog_price`: an upper bound), and the note says so."""
    found = catalog_price(gpu, pricing)
    peak = peak_flops(gpu, work.precision, tf32)
    if not found or not found[0] or not peak or not gpu.memory_gb:
        return None
    price, priced_at = found
    slow, note = 1.0, "" if priced_at == pricing else f" ({priced_at}: no {pricing} price)"
    if not work.fits(work.estimate(ac_every=0), gpu.memory_gb):
        if not work.fits(work.estimate(ac_every=1), gpu.memory_gb):
            return None
        slow, note = AC_SLOWDOWN, f" with activation checkpointing{note}"
    tokens_per_sec = peak * mfu * slow / fpt
    return usd_per_billion_tokens(tokens_per_sec, price, 1), note


def price_findings(
    work: Workload,
    here: GpuConfig,
    catalog: dict[str, GpuConfig],
    cost: CostConfig,
    tf32: bool,
    assumed_mfu: float,
    bench_mfu: float | None,
) -> list[Finding]:
    """This GPU's $/token against the catalog's cheapest GPU that fits the model: the others at
    `assumed_mfu`, this one at the MFU `lm bench` measured on it (`bench_mfu`) if any."""
    if not work.cuda or not catalog:
        return []
    pricing = cost.pricing
    fpt = flops_per_token(work.model, work.seq_len)
    mfu = assumed_mfu
    # A measured MFU prices this GPU better; the others stay at the assumed one (no bench ran on them).
    mine = usd_per_btok(here, work, fpt, bench_mfu or mfu, pricing, tf32)
    if cost.price_per_hour is not None and mine is not None:  # the user's own rate
        peak = peak_flops(here, work.precision, tf32)
        rate = peak * (bench_mfu or mfu) * (AC_SLOWDOWN if "checkpointing" in mine[1] else 1.0) / fpt
        mine = (usd_per_billion_tokens(rate, cost.price_per_hour, 1), mine[1])
    options = {
        name: r for name, g in catalog.items() if (r := usd_per_btok(g, work, fpt, mfu, pricing, tf32))
    }
    if mine is None or not options:
        return [
            Finding("$/token", "ok", f"no {pricing} price, peak or memory for gpu={here.name}: not compared")
        ]
    options[here.name] = mine
    best = min(options, key=lambda k: options[k][0])
    basis = f"MFU {bench_mfu:.0%} measured by lm bench" if bench_mfu else f"MFU {mfu:.0%} assumed"
    this = f"~${mine[0]:.2f}/Btok on {here.name}{mine[1]} ({pricing}, {basis})"
    if options[best][0] < 0.9 * mine[0] and best != here.name:
        saving = 1 - options[best][0] / mine[0]
        return [
            Finding(
                "$/token",
                "warn",
                f"{this}; {best} ~${options[best][0]:.2f}/Btok{options[best][1]}",
                f"-{saving:.0%} $/token at the same MFU, unmeasured there: check availability, then "
                f"`lm bench` on it and `lm bench --compare` (seed 000)",
                f"gpu={best} (rent one)",
            )
        ]
    return [Finding("$/token", "ok", f"{this}: the catalog's cheapest that fits")]
