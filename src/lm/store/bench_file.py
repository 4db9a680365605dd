"""bench.json: what `lm bench` measured, written by the bench and read by `lm bench --compare` and the doctor.

{"command": [...], "pricing": "on_demand", "fixed": [...], "config": {bench settings},
 "model": {the ModelConfig benched}, "results": [Result, ...], "recommended": [...] | null}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lm.base.exits import Refused
from lm.model import ModelConfig
from lm.store.atomic import write_atomic

BENCH_JSON = "bench.json"
BENCH_MD = "bench.md"


@dataclass
class Result:
    """One combination's measurement."""

    combo: list[str]
    """The swept overrides that define this combination (`kernels=compile`, ...)."""
    status: str = "error"
    """`ok`, `does not fit` (out of memory) or `error`."""
    error: str = ""
    tokens_per_sec: float | None = None
    step_seconds: float | None = None
    mfu: float | None = None
    peak_mem_gb: float | None = None
    peak_mem_kind: str = ""
    """What peak_mem_gb measures: `cuda max allocated` or `cpu peak RSS`."""
    estimate_gb: float | None = None
    """lm.numbers.memory's estimate of the same step (allocated bytes, no CUDA overhead)."""
    usd_per_btok: dict[str, float] = field(default_factory=dict)
    """$/10^9 tokens at each price for this device (`on_demand`, `spot`, `price_per_hour`)."""
    device: str = ""
    gpu: str = ""
    """Catalog entry of the device (`a100_80gb`, `cpu`, ...): the doctor reads measured MFU by it."""
    precision: str = ""
    params: int | None = None
    ac_every: int | None = None
    """The activation checkpointing stride trained with (what `activation_checkpointing=auto` resolved to)."""
    note: str = ""
    """What the combination resolved to, where the configuration left it to be decided (`auto`)."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Result:
        """A row of any bench.json, ignoring fields this version does not know."""
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})


def write_bench(out_dir: Path, payload: dict[str, Any], text: str) -> None:
    """bench.json (the payload) and bench.md (its table), each atomically."""
    write_atomic(out_dir / BENCH_JSON, json.dumps(payload, indent=2))
    write_atomic(out_dir / BENCH_MD, text)


def load_bench(path: Path) -> dict[str, Any]:
    """A bench.json (or the folder holding one), checked enough to compare; a clear error otherwise."""
    file = path / BENCH_JSON if path.is_dir() else path
    if "=" in path.name and not path.exists():
        raise Refused(
            f"{path}: looks like a Hydra override; --compare takes only bench.json files or folders"
        )
    if not file.is_file():
        raise Refused(f"{path}: no bench.json there; run `lm bench ... bench.out_dir={path}` on that machine")
    try:
        payload = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Refused(f"{file}: not a bench.json written by lm bench ({e})") from e
    if not isinstance(payload, dict) or not isinstance(payload.get("results"), list):
        raise Refused(f"{file}: not a bench.json written by lm bench (no `results` list)")
    return payload


def without_init(model: dict) -> dict:
    """A model config less `init_from`: where the weights start does not change a step's speed."""
    return {k: v for k, v in model.items() if k != "init_from"}


def measured_mfu(
    out_dir: Path, gpu: str, model: ModelConfig, n_params: int, fp8_peak_ratio: float = 1.0
) -> float | None:
    """The best MFU `lm bench` measured for this model on this catalog GPU (bench.json in `out_dir`), as a
    fraction of the GPU's bf16 peak (the rate every plan multiplies), or None.

    An FP8 row's MFU is against the FP8 peak: times `fp8_peak_ratio` (the GPU's FP8/bf16 peaks,
    `lm.numbers.cost.fp8_peak_ratio`) it is against the bf16 peak, so a measured FP8 speed-up reaches `lm plan`
    and the doctor. The model must be the one benched: its config where the bench recorded
    it, else its parameter count (benches written before the config was recorded). A tiny model's MFU says
    nothing about a 1B run's.
    """
    try:
        payload = load_bench(Path(out_dir))
    except Refused:
        return None
    if "model" in payload and without_init(payload["model"]) != without_init(asdict(model)):
        return None
    mfus = [
        r["mfu"] * (fp8_peak_ratio if "fp8" in r.get("precision", "") else 1.0)
        for r in payload["results"]
        if r.get("gpu") == gpu
        and r.get("status") == "ok"
        and r.get("mfu")
        and ("model" in payload or r.get("params") == n_params)
    ]
    return max(mfus) if mfus else None
