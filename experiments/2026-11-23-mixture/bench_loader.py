"""Loader throughput of a 3-source data mixture against one source, and the proportions the mixture draws.

    PYTHONPATH=src python experiments/2026-11-23-mixture/bench_loader.py [--steps 300] [--workers 2] [--repeats 5]

Both loaders read the same tokens: the stdlib corpus cut into documents, split three ways for the mixture and
kept whole for the single source, all tokenized by one tokenizer. Each timing is the real DataLoader (workers,
batch sampler, TokenWindows reads) over the same number of batches, alternating with each other --repeats times in one process (medians), so the
ratio is comparable even on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from lm.config import DataConfig, MixtureSource
from lm.data import StepSampler, TokenWindows, load_manifest, prepare, shard_paths
from lm.data.allocation import Allocation
from lm.data.mixture import MixtureSampler, MixtureWindows
from lm.data.stdlib import stdlib_documents
from lm.data.tokenizer import train_tokenizer

WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


def prepare_corpora(root: Path, max_bytes: int, vocab: int, seq_len: int) -> dict[str, Path]:
    """One tokenizer; three sources (every third 40-line document) and the whole corpus as one source."""
    pieces = []
    for doc in stdlib_documents(max_bytes=max_bytes).documents:
        lines = doc.text.splitlines(keepends=True)
        pieces += ["".join(lines[i : i + 40]) for i in range(0, len(lines), 40)]
    tokenizer = root / "tokenizer.json"
    train_tokenizer(pieces[::4], vocab).save(str(tokenizer))
    parts = {name: pieces[i::3] for i, name in enumerate(WEIGHTS)} | {"all": pieces}
    folders = {}
    for name, texts in parts.items():
        (root / "text" / name).mkdir(parents=True)
        for i, text in enumerate(texts):
            (root / "text" / name / f"{i}.txt").write_text(text)
        cfg = DataConfig(
            source="text", paths=[str(root / "text" / name / "*.txt")], tokenizer=str(tokenizer),
            vocab_size=vocab, seq_len=seq_len, cache_dir=str(root / "cache"), dir=str(root / "tokens" / name),
            num_proc=1,
        )  # fmt: skip
        folders[name] = prepare(cfg)
    return folders


def windows(folder: Path, seq_len: int) -> TokenWindows:
    m = load_manifest(folder)
    return TokenWindows(shard_paths(folder, m, "train"), seq_len, m["dtype"], m["vocab_size"])


def rate(dataset, sampler, steps: int, workers: int, clock=time.perf_counter) -> float:
    """Windows per second of `clock` over `steps` batches through a fresh DataLoader, its first batch (worker
    start-up) excluded. With workers=0 and clock=time.process_time it counts this process's CPU seconds only,
    which a neighbour's load barely moves; wall-clock rates on a shared machine swing by 2x."""
    it = iter(DataLoader(dataset, batch_sampler=sampler, num_workers=workers))
    next(it)
    t0, n = clock(), 0
    for _ in range(steps):
        n += len(next(it))
    return n / (clock() - t0)


def compare(single, mixed, schedule, args, workers: int, clock=time.perf_counter) -> dict:
    """Single source and mixture timed in alternation, so a neighbour's load hits both alike; the medians and
    their ratio."""
    one, mix = [], []
    for i in range(args.repeats):  # which goes first alternates too (ABBA...): warm caches favour neither
        runs = [
            lambda: one.append(
                rate(single, StepSampler(len(single), args.batch), args.steps, workers, clock)
            ),
            lambda: mix.append(
                rate(mixed, MixtureSampler(schedule, mixed.offsets, args.batch), args.steps, workers)
            ),
        ]
        for run in runs if i % 2 == 0 else runs[::-1]:
            run()
    return {
        "single_windows_per_s": round(float(np.median(one))),
        "mixture_windows_per_s": round(float(np.median(mix))),
        "ratio_of_medians": round(float(np.median(mix) / np.median(one)), 3),
        "ratios_per_round": [round(m / o, 3) for m, o in zip(mix, one)],
    }


def sampler_cost(sampler, n: int = 3000) -> float:
    """Microseconds the batch sampler itself takes per batch (it runs in the training process)."""
    it = iter(sampler)
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    return round((time.perf_counter() - t0) / n * 1e6, 1)


def proportions(sampler: MixtureSampler, offsets: np.ndarray, steps: int, stretches=(1, 7, 100)) -> dict:
    """Each source's share over all `steps`, and its largest deviation from its weight over any run of
    consecutive steps of each length in `stretches`."""
    it = iter(sampler)
    per_step = np.array(
        [np.bincount(np.searchsorted(offsets, next(it), side="right") - 1, minlength=3) for _ in range(steps)]
    )
    share = per_step.sum(0) / per_step.sum()
    out = {
        name: {"weight": w, "share": round(float(share[k]), 5)} for k, (name, w) in enumerate(WEIGHTS.items())
    }
    for stretch in stretches:
        sums = np.lib.stride_tricks.sliding_window_view(per_step, stretch, axis=0).sum(-1)
        dev = np.abs(sums / sums.sum(1, keepdims=True) - np.array(list(WEIGHTS.values()))).max(0)
        for k, name in enumerate(WEIGHTS):
            out[name][f"max_abs_dev_any_{stretch}_steps"] = round(float(dev[k]), 5)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-bytes", type=int, default=6_000_000)
    p.add_argument("--out", default=str(Path(__file__).parent / "results.json"))
    args = p.parse_args()
    # One intra-op thread, as torch gives each DataLoader worker: with more, idle OpenMP threads spin and the
    # CPU-time measure counts their spinning (it read 2-5x the wall clock in the in-process loader).
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folders = prepare_corpora(Path(tmp), args.max_bytes, 1024, args.seq_len)
        prep_s = time.perf_counter() - t0
        single = windows(folders["all"], args.seq_len)
        mixed = MixtureWindows([windows(folders[n], args.seq_len) for n in WEIGHTS])
        specs = [MixtureSource(n, w, dir=str(folders[n])) for n, w in WEIGHTS.items()]
        schedule = Allocation(specs, [len(p) for p in mixed.parts], args.batch)
        results = {"args": vars(args), "prepare_s": round(prep_s, 1), "windows": {"single": len(single)}}
        results["windows"].update({n: len(p) for n, p in zip(WEIGHTS, mixed.parts)})
        results["workers=0, CPU time"] = compare(single, mixed, schedule, args, 0, time.process_time)
        for workers in sorted({0, args.workers}):
            results[f"workers={workers}, wall clock"] = compare(single, mixed, schedule, args, workers)
        results["sampler_us_per_batch"] = {
            "single": sampler_cost(StepSampler(len(single), args.batch)),
            "mixture": sampler_cost(MixtureSampler(schedule, mixed.offsets, args.batch)),
        }
        results["proportions"] = proportions(
            MixtureSampler(schedule, mixed.offsets, args.batch), mixed.offsets, 10_000
        )
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
