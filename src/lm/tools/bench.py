"""`lm bench`: tokens/s, MFU, peak memory and $/billion tokens of the user's model on this machine, for each
combination of knobs (`lm bench kernels=eager,compile activation_checkpointing=off,on`: comma lists expand as a
Hydra multirun).

Each combination runs in a fresh process (an out-of-memory, a compile cache or a peak-memory counter must not
leak into the next) with the module and Trainer `lm.run.build` builds for training, so the numbers are what
training gets; batches are random ids already in memory, so it measures the model and its knobs, not the data
pipeline (the doctor checks the workers). Rows are ranked by $/Btok (one device: tokens/s) and the cheapest
that fits is recommended; bench.json and bench.md go to `bench.out_dir`."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from lm.base.exits import Refused
from lm.callbacks.steps import StepWatch
from lm.config import LMConfig, compose, conf_dir, to_objects
from lm.engine import activation_checkpointing, runtime
from lm.numbers import cost, memory, run_plan
from lm.run import build
from lm.store.atomic import write_atomic
from lm.store.bench_file import Result, load_bench, write_bench

log = logging.getLogger(__name__)

OOM_MARKERS = ("out of memory", "can't allocate memory", "not enough memory", "cannot allocate memory")


def expand(overrides: list[str]) -> tuple[list[str], list[list[str]]]:
    """(fixed overrides, one list of swept overrides per combination), in Hydra's multirun order."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed, sweeps = [], []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            sweeps.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            fixed.append(o.input_line)
    return fixed, [list(c) for c in itertools.product(*sweeps)]


def is_oom(e: BaseException) -> bool:
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return any(m in str(e).lower() for m in OOM_MARKERS)


def limit_memory(limit_gb: float, cuda: bool) -> None:
    """Cap what this process may allocate: a fraction of the GPU, or the CPU address space it may grow by."""
    limit = limit_gb * 1e9
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
        return
    # Start the thread pools first (each thread reserves its stack), so the cap counts tensors, not threads.
    (torch.ones(512, 512) @ torch.ones(512, 512)).add_(1).sum()
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * page
    resource.setrlimit(resource.RLIMIT_AS, (int(vm + limit), resource.RLIM_INFINITY))


class Clock(pl.Callback):
    """Wall clock at each optimizer step's end, after the device has finished it."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.stamps: list[float] = []
        self.steps = StepWatch()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.start(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.steps.advance(trainer):
            if self.cuda:
                torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())


def measure(overrides: list[str], combo: list[str]) -> Result:
    """Run one combination in this process (the worker side) and measure it."""
    result = Result(combo)
    cfg = to_objects(compose(overrides))
    cuda = False
    try:
        # Liger without CUDA: an error row naming the fix
        rt = runtime.resolve(cfg.trainer, cfg.gpu, cfg.precision, cfg.kernels, cfg.optim, cfg.cost)
        cuda = rt.cuda
        result.device, result.gpu, result.precision = rt.device_name, rt.gpu.name, rt.precision_label
        runtime.set_matmul_precision(cfg.precision.tf32)
        if cfg.bench.memory_limit_gb is not None:  # before `auto` decides: its trials must see the cap
            limit_memory(cfg.bench.memory_limit_gb, cuda)
        clock = fit_steps(cfg, rt, result)
    except Exception as e:  # classify: out of memory is a result, anything else an error with its message
        result.status = "does not fit" if is_oom(e) else "error"
        result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        return result
    finally:
        result.peak_mem_gb, result.peak_mem_kind = peak_memory(cuda)
    return timed(cfg, rt, result, clock.stamps)


def fit_steps(cfg: LMConfig, rt: runtime.Runtime, result: Result) -> Clock:
    """Train warmup_steps + steps optimizer steps on random tokens with the module and Trainer a run builds
    (`lm.run.build`), on one device, without the run's callbacks, logger or saves."""
    b, t = cfg.data.batch_size, cfg.data.seq_len
    decision = build.decide_now(cfg, rt)  # `auto` measured as training would
    result.ac_every = decision.every
    if cfg.activation_checkpointing.auto:
        result.note = "auto: " + activation_checkpointing.describe(decision.every)
    est = memory.estimate(cfg.model, batch_size=b, seq_len=t, precision=rt.precision, ac_every=decision.every)
    result.estimate_gb = round(est.allocated / 1e9, 3)
    total = cfg.bench.warmup_steps + cfg.bench.steps
    # Random tokens: model.doc_mask's mask is built and applied, at about one document a window.
    module = build.build_module(
        cfg, rt, decision, init_from=False, total_steps=max(total, cfg.optim.warmup_steps + 1), eot_id=0
    )
    result.params = module.model.num_parameters()
    clock = Clock(rt.cuda)
    trainer = build.build_trainer(
        cfg,
        Path(tempfile.mkdtemp(prefix="lm-bench-")),
        rt.precision,
        [clock],
        devices=1,
        num_nodes=1,
        strategy="auto",  # one device: there is no data parallelism to measure
        plugins=[],  # no saves, and one process of its own rather than a rank of the cluster's job
        max_steps=total,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(cfg.run.seed)
    batches = [torch.randint(0, cfg.model.vocab_size, (b, t + 1)) for _ in range(4)]
    n = total * cfg.trainer.accumulate_grad_batches
    loader = torch.utils.data.DataLoader([batches[i % len(batches)] for i in range(n)], batch_size=None)
    if rt.cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, train_dataloaders=loader)
    return clock


def peak_memory(cuda: bool) -> tuple[float, str]:
    """(GB, what it measures): CUDA's allocated high-water mark, or the process's peak resident set."""
    if cuda:
        return round(torch.cuda.max_memory_allocated() / 1e9, 3), "cuda max allocated"
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3), "cpu peak RSS"


def timed(cfg: LMConfig, rt: runtime.Runtime, result: Result, stamps: list[float]) -> Result:
    """Tokens/s, MFU and $/Btok from the timed steps' clock stamps (the warm-up ones left out)."""
    timed_stamps = stamps[cfg.bench.warmup_steps - 1 :] if cfg.bench.warmup_steps else stamps
    if len(timed_stamps) < 2:
        result.error = f"only {len(stamps)} steps were timed"
        return result
    seconds = (timed_stamps[-1] - timed_stamps[0]) / (len(timed_stamps) - 1)
    # a bench trains on one device
    tokens_per_step = run_plan.resolve(cfg.data, cfg.trainer, cfg.optim, world=1).tokens_per_device_step
    result.status, result.step_seconds = "ok", round(seconds, 5)
    result.tokens_per_sec = round(tokens_per_step / seconds, 1)
    fpt = cost.flops_per_token(cfg.model, cfg.data.seq_len)
    peak = cost.peak_flops(rt.gpu, rt.precision, cfg.precision.tf32, fp8=rt.fp8 is not None)
    mfu = cost.mfu(result.tokens_per_sec, fpt, peak, 1)
    result.mfu = round(mfu, 4) if mfu is not None else None
    result.usd_per_btok = catalog_usd_per_btok(result.tokens_per_sec, rt.gpu)
    if cfg.cost.price_per_hour:
        result.usd_per_btok["price_per_hour"] = round(
            cost.usd_per_billion_tokens(result.tokens_per_sec, cfg.cost.price_per_hour, 1), 4
        )
    return result


def catalog_usd_per_btok(tokens_per_sec: float, gpu) -> dict[str, float]:
    """$/10^9 tokens at each price the catalog records for `gpu` (`on_demand`, `spot`)."""
    return {
        name: round(cost.usd_per_billion_tokens(tokens_per_sec, price, 1), 4)
        for name, price in cost.catalog_prices(gpu).items()
    }


def run_one(overrides: list[str], combo: list[str], timeout: float) -> Result:
    """Measure one combination in a fresh Python process; a crash or a hang becomes an `error` row."""
    with tempfile.TemporaryDirectory(prefix="lm-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "lm.tools.bench",
            "--worker",
            json.dumps(overrides),
            json.dumps(combo),
            str(out),
        ]
        # Few malloc arenas: a CPU memory cap counts address space, and every thread's arena reserves 64 MB.
        env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return Result(combo, error=f"still running after bench.timeout_s={timeout:g} s")
        if out.is_file():
            return Result(**json.loads(out.read_text()))
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        why = "killed (host out of memory?)" if proc.returncode in (-9, 137) else f"exit {proc.returncode}"
        return Result(combo, error=f"{why}: {' | '.join(tail)}")


STATUS_ORDER = {"ok": 0, "does not fit": 1, "error": 2}


def rank_key(r: Result, pricing: str) -> tuple:
    """ok rows by $/Btok at `pricing`, rows without that price after the priced ones (by tokens/s), then
    `does not fit`, then errors."""
    price = r.usd_per_btok.get(pricing)
    return (STATUS_ORDER.get(r.status, 2), price is None, price or 0.0, -(r.tokens_per_sec or 0.0))


def rank(results: list[Result], pricing: str) -> list[Result]:
    """`results` in `rank_key` order."""
    return sorted(results, key=lambda r: rank_key(r, pricing))


def measured_cells(r: Result, prices: list[str]) -> list[str]:
    """A row's measured columns: tokens/s, MFU, peak memory, the estimate, $/Btok at each of `prices`."""
    cells = [
        f"{r.tokens_per_sec:,.0f}" if r.tokens_per_sec else "-",
        f"{r.mfu:.1%}" if r.mfu is not None else "n/a",
        f"{r.peak_mem_gb:.2f}" if r.peak_mem_gb is not None and r.status == "ok" else "-",
        f"{r.estimate_gb:.2f}" if r.estimate_gb is not None else "-",
    ]
    return cells + [f"{r.usd_per_btok[p]:.2f}" if p in r.usd_per_btok else "-" for p in prices]


def note_cell(r: Result) -> str:
    return "; ".join(filter(None, [r.note, r.error.replace("|", "/")[:120]]))


def price_columns(results: list[Result]) -> list[str]:
    return sorted(
        {k for r in results for k in r.usd_per_btok}, key=["on_demand", "spot", "price_per_hour"].index
    )


def markdown(results: list[Result], pricing: str, header: str) -> str:
    """The ranked table and the recommendation."""
    price_cols = price_columns(results)
    cols = ["#", "combination", "status", "tokens/s", "MFU", "peak mem GB", "est. GB"]
    cols += [f"$/Btok {p}" for p in price_cols] + ["note"]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i, r in enumerate(results, 1):
        row = [str(i), " ".join(r.combo) or "(as configured)", r.status, *measured_cells(r, price_cols)]
        row.append(note_cell(r))
        lines.append("| " + " | ".join(row) + " |")
    kind = next((r.peak_mem_kind for r in results if r.peak_mem_kind), "")
    lines += [
        "",
        f"peak mem: {kind or 'n/a'}; est.: lm.numbers.memory's allocated bytes; ranked by $/Btok {pricing}",
    ]
    lines += optimizer_overhead(results)
    lines.append(recommendation(results))
    return "\n".join(lines) + "\n"


def optimizer_overhead(results: list[Result]) -> list[str]:
    """Muon's step-time overhead (its Newton-Schulz iterations) against AdamW's row with every other setting
    equal: `lm bench optim=adamw,muon` puts the $/token of both side by side, this says what Muon costs."""

    def others(r: Result) -> tuple[str, ...]:
        return tuple(o for o in r.combo if not o.startswith("optim="))

    adamw = {others(r): r for r in results if "optim=adamw" in r.combo and r.tokens_per_sec}
    lines = []
    for r in results:
        base = adamw.get(others(r))
        if "optim=muon" in r.combo and r.tokens_per_sec and base is not None:
            where = " ".join(others(r)) or "the same settings"
            overhead = base.tokens_per_sec / r.tokens_per_sec - 1
            lines.append(f"optim=muon ({where}): step time {overhead:+.1%} against optim=adamw")
    return lines


def recommendation(ranked: list[Result]) -> str:
    best = next((r for r in ranked if r.status == "ok"), None)
    if best is None:
        return "no combination fits: lower data.batch_size or turn activation_checkpointing=on"
    return f"recommended (cheapest that fits): {' '.join(best.combo) or '(as configured)'}"


def run_bench(overrides: list[str], pricing: str | None = None) -> int:
    """Validate every combination, measure each in its own process, write bench.json/.md; exit status."""
    fixed, combos = expand(overrides)
    cfgs = [to_objects(compose(fixed + combo)) for combo in combos]  # bad input fails before any run
    for cfg in cfgs:  # Liger on a CPU is left to its row, which names the fix
        cuda = runtime.uses_cuda(cfg.trainer)
        runtime.resolve_precision(cfg.precision.mode, cuda, cuda and torch.cuda.is_bf16_supported())
    base = cfgs[0]
    # Rank by the user's own rate when given (cost.price_per_hour), else by the catalog's chosen price.
    pricing = pricing or ("price_per_hour" if base.cost.price_per_hour is not None else base.cost.pricing)
    out_dir = Path(base.bench.out_dir)
    print(f"lm bench: {len(combos)} combination(s), {base.bench.warmup_steps}+{base.bench.steps} steps each")
    results = []
    for combo, cfg in zip(combos, cfgs):
        r = run_one(fixed + combo, combo, cfg.bench.timeout_s)
        rate = f"{r.tokens_per_sec:,.0f} tokens/s" if r.tokens_per_sec else r.error
        print(f"  {' '.join(combo) or '(as configured)'}: {r.status}, {rate}", flush=True)
        results.append(r)
    ranked = rank(results, pricing)
    device = next((r.device for r in results if r.device), "unknown device")
    header = (
        f"# lm bench on {device} ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
        f"`lm bench {' '.join(overrides)}`  \n{base.bench.warmup_steps} warm-up + {base.bench.steps} timed steps "
        f"per combination, each in a fresh process; fixed: {' '.join(fixed) or 'none'}"
    )
    text = markdown(ranked, pricing, header)
    payload = {
        "command": ["lm", "bench", *overrides],
        "pricing": pricing,
        "fixed": fixed,
        "config": OmegaConf.to_container(OmegaConf.structured(base.bench)),
        "model": asdict(base.model),
        "results": [asdict(r) for r in ranked],
        "recommended": next((r.combo for r in ranked if r.status == "ok"), None),
    }
    write_bench(out_dir, payload, text)
    print(text, end="")
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'}")
    return 0 if payload["recommended"] is not None else 1


# -- comparing benches from several machines ---------------------------------------------------------------

SWEEP_ONLY = ("bench.",)
"""Override prefixes that say how a bench ran, not what it measured: left out of a row's label."""


def compare(paths: list[Path], pricing: str, catalog: dict | None = None) -> tuple[list[dict], str]:
    """Merge `lm bench` results from several machines into one table ranked by $/Btok at `pricing`.

    Each GPU's $/Btok is recomputed from its measured tokens/s at the catalog's current prices (the catalog
    given, else what the bench recorded); `price_per_hour` stays what that bench was given. A row's label is
    its combination plus the fixed overrides that differ between the benches. Benches of different models
    (parameter counts) are refused: their $/token answer different questions.
    """
    if len(paths) < 1:
        raise Refused("lm bench --compare needs at least one bench.json (or its folder)")
    benches = [(p, load_bench(p)) for p in paths]

    def label_of(fixed: list[str]) -> set[str]:
        return {o for o in fixed if not o.lstrip("+~").startswith(SWEEP_ONLY)}

    common = set.intersection(*(label_of(b.get("fixed", [])) for _, b in benches))
    rows = []
    for path, bench in benches:
        extra = sorted(label_of(bench.get("fixed", [])) - common)
        for raw in bench["results"]:
            r = Result.from_dict(raw)
            gpu = catalog.get(r.gpu) if catalog and r.gpu else None
            if gpu is not None and r.tokens_per_sec:  # today's catalog prices; the user's own rate stays
                own = {k: v for k, v in r.usd_per_btok.items() if k == "price_per_hour"}
                r.usd_per_btok = catalog_usd_per_btok(r.tokens_per_sec, gpu) | own
            rows.append(
                {"result": r, "label": " ".join([*extra, *r.combo]) or "(as configured)", "from": str(path)}
            )
    models = {r["result"].params for r in rows if r["result"].params}
    if len(models) > 1:
        raise Refused(
            "these benches measured different models ("
            + ", ".join(f"{n:,}" for n in sorted(models))
            + " parameters): compare benches of one model (the same model= and data.vocab_size=)"
        )
    rows.sort(key=lambda row: rank_key(row["result"], pricing))
    return rows, compare_markdown(rows, pricing, len(benches))


def compare_markdown(rows: list[dict], pricing: str, n_benches: int) -> str:
    """The merged, ranked table of `compare`, with its caveat and the recommendation."""
    prices = price_columns([row["result"] for row in rows])
    cols = ["#", "gpu", "combination", "status", "tokens/s", "MFU", "peak mem GB", "est. GB"]
    cols += [f"$/Btok {p}" for p in prices] + ["note", "from"]
    lines = [
        f"# lm bench --compare ({n_benches} benches, ranked by $/Btok {pricing})",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for i, row in enumerate(rows, 1):
        r = row["result"]
        cells = [str(i), r.gpu or r.device or "?", row["label"], r.status, *measured_cells(r, prices)]
        cells += [note_cell(r), row["from"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Rows from different benches ran on different machines at different times: a tokens/s ratio between "
        "them is not a same-run ratio. $/Btok is at the catalog's prices (conf/gpu/) as of now; a row with no "
        f"{pricing} price ranks after the priced ones.",
    ]
    best = next(
        (row for row in rows if row["result"].status == "ok" and pricing in row["result"].usd_per_btok), None
    )
    if best is None:
        lines.append(f"no row that fits has a {pricing} price: nothing to recommend")
    else:
        r = best["result"]
        lines.append(
            f"cheapest that fits at {pricing} prices: gpu={r.gpu} {best['label']} "
            f"(${r.usd_per_btok[pricing]:.2f}/Btok, {r.tokens_per_sec:,.0f} tokens/s)"
        )
    return "\n".join(lines) + "\n"


def run_compare(paths: list[str], pricing: str, out: str | None) -> int:
    """`lm bench --compare`: print the merged table and write it (with a JSON twin) when `out` is given."""
    rows, text = compare([Path(p) for p in paths], pricing, cost.load_catalog(conf_dir()))
    print(text, end="")
    if out:
        md = Path(out)
        write_atomic(md, text)
        payload = [{**asdict(row["result"]), "label": row["label"], "from": row["from"]} for row in rows]
        write_atomic(md.with_suffix(".json"), json.dumps({"pricing": pricing, "rows": payload}, indent=2))
        print(f"wrote {md} and {md.with_suffix('.json')}")
    return 0 if any(row["result"].status == "ok" for row in rows) else 1


def worker_main(argv: list[str]) -> None:
    """`python -m lm.tools.bench --worker OVERRIDES_JSON COMBO_JSON OUT`: measure and write the result."""
    logging.basicConfig(level=logging.WARNING)
    overrides, combo, out = json.loads(argv[0]), json.loads(argv[1]), Path(argv[2])
    result = measure(overrides, combo)
    write_atomic(out, json.dumps(asdict(result)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lm.tools.bench")
    parser.add_argument("--worker", nargs=3, required=True, metavar=("OVERRIDES", "COMBO", "OUT"))
    worker_main(parser.parse_args().worker)
