"""The worker side of `lm prepare`: a pool of forked processes, each tokenizing whole units into their train and
val shards (written atomically: temporary file, fsync, rename), and the parent's handling of stop signals, so
no worker outlives an interrupted preparation. `lm.data.shards` plans the units and records what they return.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from lm.base.exits import Interrupted, Refused
from lm.config import DataConfig
from lm.data import sources
from lm.data.manifest import SPLITS, token_dtype
from lm.data.sources import Skip, Unit, is_validation, split_key
from lm.data.tokenizer import tokenizer_id

log = logging.getLogger("lm.data")

ENCODE_BYTES = 1 << 20
"""Text per encode_batch call: enough to amortize the call, small enough to bound a worker's memory."""
MAX_LISTED_DOCUMENTS = 100_000
"""Document names are kept in the manifest (for inspection and tests) only for corpora up to this size."""
LOG_EVERY_S = 30.0


class ShardWriter:
    """Appends token arrays to `<name>` through a temporary file; `close()` fsyncs and renames it into place."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype):
        self.path = folder / name
        self.tmp = folder / f".{name}.tmp-{os.getpid()}"
        self.dtype = dtype
        self.file = open(self.tmp, "wb")  # noqa: SIM115
        self.sha = hashlib.sha256()
        self.tokens = self.documents = self.bytes = 0

    def write(self, ids: np.ndarray) -> None:
        data = ids.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.tokens += len(ids)

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        return {
            "file": self.path.name,
            "tokens": self.tokens,
            "documents": self.documents,
            "bytes": self.bytes,
            "sha256": self.sha.hexdigest(),
        }


# --- one unit of work (runs in a worker process) -----------------------------------------------------------

_worker: dict = {}


def _init_worker(cfg: DataConfig, tokenizer_json: str, out: str, forced: dict, counters) -> None:
    """Per-process state: each worker owns a tokenizer, so no Rust thread pool is shared across a fork."""
    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" inside a document is text, not a boundary
    eot = tokenizer_id(tok, cfg.eot_token)
    _worker.update(cfg=cfg, tok=tok, eot=eot, out=Path(out), forced=forced, counters=counters)


def _init_pool_worker(*args) -> None:
    """A pool worker leaves stop signals to the parent, which terminates the pool (`stop_on_signals`): SIGTERM
    ends it at once (the parent's handler is not inherited), Ctrl-C's SIGINT to the whole group is ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(*args)


def is_val(text: str, cfg: DataConfig, forced: dict) -> bool:
    """Whether a document goes to the val split: by its content (`split_key`), unless `forced_validation`
    moved it across."""
    key = split_key(text)
    return forced[key] if key in forced else is_validation(key, cfg.val_fraction)


def tokenize_unit(unit: Unit) -> dict:
    """Tokenize every document of `unit` into its train and val shards; returns its progress record."""
    cfg, tok, eot, out = _worker["cfg"], _worker["tok"], _worker["eot"], _worker["out"]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: about a third less CPU
    dtype = token_dtype(cfg.vocab_size)
    writers = {s: ShardWriter(out, f"{s}-{unit.index:05d}.bin", dtype) for s in SPLITS}
    names: dict[str, list[str]] | None = {s: [] for s in SPLITS}
    skips: list[Skip] = []
    t0 = time.perf_counter()

    def flush(batch: list[tuple[str, str]]) -> None:
        nonlocal names
        encodings = encode([text for _, text in batch], add_special_tokens=False)
        bufs: dict[str, list[int]] = {s: [] for s in SPLITS}
        n_bytes = 0
        for (name, text), enc in zip(batch, encodings):
            split = "val" if is_val(text, cfg, _worker["forced"]) else "train"
            bufs[split].extend(enc.ids)
            bufs[split].append(eot)
            size = len(text.encode("utf-8"))
            writers[split].documents += 1
            writers[split].bytes += size
            n_bytes += size
            if names is not None:
                names[split].append(name)
        for split, buf in bufs.items():
            if buf:
                ids = np.array(buf, dtype=np.int64)
                if ids.max() >= cfg.vocab_size:
                    raise Refused(
                        f"the tokenizer produced id {ids.max()} >= data.vocab_size={cfg.vocab_size}; set "
                        f"data.vocab_size to at least the tokenizer's vocabulary size"
                    )
                writers[split].write(ids)
        if names is not None and sum(map(len, names.values())) > MAX_LISTED_DOCUMENTS:
            names = None
        counters_add(n_bytes, sum(map(len, bufs.values())))

    batch, batch_bytes = [], 0
    for doc in sources.read_unit(unit, cfg, skips):
        batch.append((doc.name, doc.text))
        batch_bytes += len(doc.text)
        if batch_bytes >= ENCODE_BYTES:
            flush(batch)
            batch, batch_bytes = [], 0
    if batch:
        flush(batch)
    shards = {s: w.close() for s, w in writers.items()}
    return {
        "unit": unit.index,
        "shards": shards,
        "skips": [asdict(s) for s in skips],
        "documents": names,
        "seconds": round(time.perf_counter() - t0, 3),
    }


COUNTER_LOCK_S = 1.0
"""How long a worker waits for the progress counters' lock: a worker killed while holding it never gives it
back, and the others must not wait for ever (the counts only draw the progress bar)."""


def counters_add(n_bytes: int, n_tokens: int) -> None:
    counters = _worker.get("counters")
    if counters is None:
        return
    lock = counters[0].get_lock()
    if not lock.acquire(timeout=COUNTER_LOCK_S):
        return  # a worker died holding it: the bar undercounts, nothing waits
    try:
        counters[0].get_obj().value += n_bytes
        counters[1].get_obj().value += n_tokens
    finally:
        lock.release()


def counted(counter) -> int:
    """A progress counter's value, read without its lock (which a killed worker may hold for ever)."""
    return counter.get_obj().value


def kill_new_children(before: set[int]) -> None:
    """SIGKILL the worker processes started since `before` (their pids): none may rename a shard after an
    interruption, and a SIGTERM can land on one still starting and be swallowed there (d1e0532)."""
    for child in mp.active_children():
        if child.pid not in before:
            child.kill()


# --- the pool (runs in the parent) ----------------------------------------------------------------------


def run_units(cfg: DataConfig, todo: list[Unit], tokenizer_json: str, out: Path, forced: dict, total_bytes):
    """Tokenize `todo` on data.num_proc processes, yielding each unit's record as it completes."""
    from tqdm.auto import tqdm

    counters = (mp.Value("q", 0), mp.Value("q", 0))
    procs = min(cfg.num_proc or os.cpu_count() or 1, len(todo))
    args = (cfg, tokenizer_json, str(out), forced, counters)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"tokenizing ({procs} proc)", disable=None)
    t0 = time.perf_counter()

    last_log = [t0]

    def update() -> None:
        now = time.perf_counter()
        rate = counted(counters[1]) / max(now - t0, 1e-9)
        bar.update(counted(counters[0]) - bar.n)
        bar.set_postfix_str(f"{rate / 1e3:,.0f}K tok/s")
        if bar.disable and now - last_log[0] > LOG_EVERY_S:  # no terminal (a job's log file): a line instead
            last_log[0] = now
            done = f"{counted(counters[0]) / total_bytes:.1%} of " if total_bytes else ""
            log.info("tokenized %s%.1f MB, %.0fK tokens/s", done, counted(counters[0]) / 1e6, rate / 1e3)

    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    try:
        if procs <= 1:
            _init_worker(*args)
            for unit in todo:
                yield tokenize_unit(unit)
                update()
            return
        # Fork: workers inherit the loaded modules (no re-import of torch); each builds its own tokenizer and
        # runs it on one thread, since the processes already fill the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        before = {child.pid for child in mp.active_children()}
        try:  # a stop signal while the pool forks its workers: they are killed, not left starting
            pool = mp.get_context("fork").Pool(procs, initializer=_init_pool_worker, initargs=args)
        except BaseException:
            kill_new_children(before)
            raise
        with pool:
            try:
                results = pool.imap_unordered(tokenize_unit, todo)
                while True:
                    try:
                        record = results.next(timeout=0.5)
                    except mp.TimeoutError:
                        update()
                        continue
                    except StopIteration:
                        break
                    update()
                    yield record
                # Every unit is done: the workers leave on the pool's end-of-work sentinel. No signal is sent,
                # so none can land on a worker still starting, whose inherited handlers (and the at-fork hooks,
                # whose exceptions are ignored) could swallow it and leave the join waiting for ever.
                pool.close()
                pool.join()
            except BaseException:
                # Interrupted: no worker may rename a shard after this call returns. SIGKILL, for the same
                # reason; the pool's own terminate (leaving this block) then joins the dead workers.
                kill_new_children(before)
                raise
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
        update()
        bar.close()
        _worker.clear()


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGINT raise `Interrupted` (exit 75) in the main thread while units are tokenized, so the
    worker pool is terminated and joined on the way out. By default SIGTERM ends the parent alone, and its
    workers went on for seconds renaming finished shards into the folder. A repeated signal is ignored while
    the workers are being stopped. Elsewhere than the main thread (where handlers cannot be set) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[str] = []

    def stop(signum: int, frame) -> None:
        if not caught:
            caught.append(signal.Signals(signum).name)
            raise Interrupted(caught[0])

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
