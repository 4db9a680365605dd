"""Weighted data mixtures: several prepared corpora sharing one tokenizer, each step drawn from all of them.

Preparation: every source is prepared alone, the corpora with one shared tokenizer (trained on a weighted
sample of them unless one is given). Training: which source each sample comes from is the Allocation
(lm.data.allocation, pure arithmetic); the MixtureSampler maps it to windows, each source visiting its
windows in its own seeded permutation per epoch.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.config import DataConfig, MixtureSource, PhaseConfig
from lm.data import shards, sources
from lm.data.allocation import Allocation, Interleave
from lm.data.datamodule import LMDataModule
from lm.data.dataset import StepSampler, TokenWindows, val_batches
from lm.data.manifest import (
    TOKENIZER,
    cache_key,
    check_tokenizer,
    load_manifest,
    prepared_folder,
    resolve_cache_dir,
    shard_paths,
    verify_shards,
)
from lm.data.shards import prepare
from lm.data.tokenizer import sample_texts, train_tokenizer
from lm.numbers.run_plan import RunPlan
from lm.store.atomic import write_atomic
from lm.store.objects import is_url

log = logging.getLogger("lm.data")


def source_config(data: DataConfig, source: MixtureSource, tokenizer: str | None = None) -> DataConfig:
    """The DataConfig that prepares and reads one source: `data`'s fields with the source's own over them. A
    corpus to prepare is tokenized by `tokenizer` (the mixture's shared one) unless its own fields name one."""
    if source.dir is not None:
        return dataclasses.replace(data, mixture=[], source="tokens", dir=source.dir)
    return dataclasses.replace(data, mixture=[], tokenizer=tokenizer or data.tokenizer, **source.data)


def mixture_sources(cfg: DataConfig, train: bool = True) -> list[DataConfig] | None:
    """Every source's DataConfig, the corpora to prepare sharing one tokenizer (`shared_tokenizer`); None
    when that tokenizer is still to be trained and `train` is false (preflight never trains one)."""
    tokenizer = shared_tokenizer(cfg, train)
    if tokenizer is None and any(s.dir is None for s in cfg.mixture):
        return None
    return [source_config(cfg, s, tokenizer) for s in cfg.mixture]


def shared_tokenizer(cfg: DataConfig, train: bool = True) -> str | None:
    """The tokenizer the mixture's corpora are prepared with: data.tokenizer; else the tokenizer.json of the
    first source given as a local prepared folder; else a BPE trained on a weighted sample of the corpora
    (each gives its weight's share of data.tokenizer_sample_bytes), kept in data.cache_dir under a hash of
    what determines it, so every later run and `lm prepare` finds the same one."""
    if cfg.tokenizer is not None:
        return cfg.tokenizer
    local = [s.dir for s in cfg.mixture if s.dir is not None and not is_url(s.dir)]
    if local:
        return str(Path(local[0]).expanduser() / TOKENIZER)
    corpora = [(s, source_config(cfg, s)) for s in cfg.mixture if s.dir is None]
    if not corpora:
        return None
    identity = {s.name: [cache_key(c), s.weight] for s, c in corpora}
    identity |= {
        "vocab_size": cfg.vocab_size,
        "sample_bytes": cfg.tokenizer_sample_bytes,
        "eot": cfg.eot_token,
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    path = resolve_cache_dir(cfg.cache_dir) / f"mixture-tokenizer-{key}.json"
    if path.is_file() or not train:
        return str(path) if path.is_file() else None
    total = sum(s.weight for s, _ in corpora)
    t0 = time.perf_counter()
    texts = itertools.chain.from_iterable(
        sample_documents(c, int(cfg.tokenizer_sample_bytes * s.weight / total))
        for s, c in corpora
        if s.weight > 0
    )
    tokenizer = train_tokenizer(texts, cfg.vocab_size, eot_token=cfg.eot_token)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, tokenizer.to_str().encode("utf-8"))
    log.info(
        "trained the mixture's shared %d-token BPE in %.1f s: %s",
        cfg.vocab_size,
        time.perf_counter() - t0,
        path,
    )
    return str(path)


def sample_documents(cfg: DataConfig, max_bytes: int) -> Iterator[str]:
    """Up to `max_bytes` of a corpus's training documents, sampled as its own tokenizer would sample them."""
    cfg = dataclasses.replace(cfg, tokenizer_sample_bytes=max_bytes)
    cfg.check_inputs()
    plan = sources.plan_units(cfg)
    return sample_texts(shards.sample_documents(cfg, plan, shards.forced_validation(cfg, plan)), max_bytes)


def prepare_mixture(cfg: DataConfig) -> list[Path]:
    """`lm prepare` of a mixture: the shared tokenizer first, then every source (a prepared folder is
    mirrored if it is a URL and checked); the folders in the mixture's order."""
    return [prepare(source) for source in mixture_sources(cfg)]


class MixtureWindows(Dataset):
    """Several sources' TokenWindows as one index space: source k's window i is item offsets[k] + i."""

    def __init__(self, parts: Sequence[TokenWindows]):
        self.parts = list(parts)
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)
        self._starts = self.offsets.tolist()  # bisect on a list: a few times faster than numpy per item

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> torch.Tensor:
        k = bisect.bisect_right(self._starts, i) - 1
        if not 0 <= i < len(self):
            raise IndexError(f"item {i} is out of range for a mixture of {len(self)} windows")
        return self.parts[k][i - self._starts[k]]


LOCATE_AHEAD = 4096
"""Samples the mixture sampler locates per call (a few hundred micro-batches of one rank)."""


class MixtureSampler(StepSampler):
    """StepSampler whose samples are allocated to sources by an Allocation, each source in its own permutation.

    Samples are indexed exactly as StepSampler indexes them (step, micro-batch, rank), so resume, skipped
    windows and world-size changes behave the same; only the sample -> window map differs.
    """

    def __init__(self, allocation: Allocation, offsets: np.ndarray, batch_size: int, **kwargs):
        super().__init__(int(offsets[-1]), batch_size, **kwargs)
        self.allocation = allocation
        self.offsets = offsets
        # Each source's current epoch order, as item indices side by side: most batches are one gather.
        self._order = np.zeros(int(offsets[-1]), dtype=np.int64)
        self._epochs = np.full(len(allocation.windows), -1, dtype=np.int64)
        self._located = (0, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))

    def source_permutation(self, k: int, epoch: int) -> np.ndarray:
        """Window order of source k's `epoch`, seeded by (seed, source, epoch)."""
        return np.random.default_rng([self.seed, k, epoch]).permutation(int(self.allocation.windows[k]))

    def located(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Allocation.locate of samples first..first+n-1, from a cache of LOCATE_AHEAD samples located at once
        (a call costs about the same for 16 samples as for thousands)."""
        lo, source, index = self._located
        if not lo <= first or first + n > lo + len(source):
            source, index = self.allocation.locate(first, max(n, LOCATE_AHEAD))
            self._located, lo = (first, source, index), first
        return source[first - lo : first - lo + n], index[first - lo : first - lo + n]

    def samples(self, first: int, n: int) -> list[int]:
        source, index = self.located(first, n)
        epochs, slots = np.divmod(index, self.allocation.windows[source])
        if (epochs != self._epochs[source]).any():
            return self.new_epochs(source, epochs, slots)
        return self._order[self.offsets[source] + slots].tolist()

    def new_epochs(self, source: np.ndarray, epochs: np.ndarray, slots: np.ndarray) -> list[int]:
        """A batch reaching a source's epoch that is not the cached one (its first, or one crossing into the
        next): every window looked up in its own epoch, and each source's latest epoch cached."""
        windows = np.empty_like(slots)
        for k, epoch in sorted(
            {(int(k), int(e)) for k, e in zip(source, epochs)}
        ):  # a source's last epoch last
            mask = (source == k) & (epochs == epoch)
            lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
            self._order[lo:hi] = lo + self.source_permutation(k, epoch)
            self._epochs[k] = epoch
            windows[mask] = self._order[lo + slots[mask]]
        return windows.tolist()


def mixed_val_batches(
    parts: Sequence[int], weights: Sequence[float], batch_size: int, world_size: int = 1, rank: int = 0
) -> tuple[list[list[int]], list[int]]:
    """This rank's validation batches over all sources, and the source of each.

    Every batch holds one source's windows (so its loss is that source's), and the sources take turns in
    proportion to the weights, so the first `trainer.limit_val_batches` of them (the mixed `val/loss`)
    weigh the sources as training does. A source out of batches drops out of the rotation.
    """
    offsets = np.concatenate([[0], np.cumsum(parts)])
    queues = [val_batches(n, batch_size, world_size, rank) for n in parts]
    total = sum(len(q) for q in queues)
    taken = [0] * len(parts)
    batches, sources = [], []
    turn = Interleave(weights).locate(0, total * len(parts))[0]
    for k in turn.tolist():
        if len(batches) == total:
            break
        if taken[k] < len(queues[k]):
            batches.append([int(offsets[k]) + i for i in queues[k][taken[k]]])
            sources.append(k)
            taken[k] += 1
    for k, queue in enumerate(queues):  # sources whose weight left them no turn above still validate
        for batch in queue[taken[k] :]:
            batches.append([int(offsets[k]) + i for i in batch])
            sources.append(k)
    return batches, sources


class MixtureDataModule(LMDataModule):
    """LMDataModule over data.mixture: every source prepared and verified alone, refused unless they share
    one tokenizer; training batches from a MixtureSampler; validation batches tagged by source."""

    def __init__(
        self, cfg: DataConfig, planned_tokens: int | None = None, phases: Sequence[PhaseConfig] = ()
    ):
        super().__init__(cfg, planned_tokens)
        self.phases = list(phases)
        self._sources: list[DataConfig] | None = None
        self.folders: list[Path] = []
        self.manifests: list[dict] = []
        self.val_sources: list[int] = []
        self.allocation: Allocation | None = None

    @property
    def sources(self) -> list[DataConfig]:
        """Each source's DataConfig; resolving it may train the shared tokenizer (`shared_tokenizer`)."""
        if self._sources is None:
            self._sources = mixture_sources(self.cfg)
        return self._sources

    def prepare_data(self) -> None:
        prepare_mixture(self.cfg)

    def check_prepared(self) -> None:
        ready = mixture_sources(self.cfg, train=False)
        if ready is not None and all(prepared_folder(s) is not None for s in ready):
            self._resolve()

    def _resolve(self) -> None:
        if self._manifest is not None:
            return
        manifests = []
        for spec, source in zip(self.cfg.mixture, self.sources):
            folder = prepare(source)
            manifest = load_manifest(folder)
            check_tokenizer(source, folder, manifest)
            verify_shards(folder, manifest, source.verify)
            check_not_empty(spec.name, folder, manifest, self.cfg.seq_len)
            self.folders.append(folder)
            manifests.append(manifest)
        check_one_tokenizer([s.name for s in self.cfg.mixture], self.folders, manifests)
        # The shared tokenizer makes one manifest speak for all: vocabulary, dtype, end-of-text id.
        self._data_dir, self._manifest = self.folders[0], manifests[0]
        self.manifests = manifests
        if manifests[0]["vocab_size"] > self.cfg.vocab_size:
            raise Refused(
                f"the mixture was tokenized with vocab_size={manifests[0]['vocab_size']} but data.vocab_size="
                f"{self.cfg.vocab_size}; set data.vocab_size={manifests[0]['vocab_size']}"
            )

    def setup(self, stage: str | None = None) -> None:
        self._resolve()
        seq_len, dtype, vocab = self.cfg.seq_len, self._manifest["dtype"], self._manifest["vocab_size"]
        sets = {
            split: MixtureWindows(
                [
                    TokenWindows(shard_paths(f, m, split), seq_len, dtype, vocab)
                    for f, m in zip(self.folders, self.manifests)
                ]
            )
            for split in ("train", "val")
        }
        self.train_set, self.val_set = sets["train"], sets["val"]

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            self.setup("fit")
        trainer = self.trainer
        world = trainer.world_size if trainer else 1
        accumulate = trainer.accumulate_grad_batches if trainer else 1
        self.allocation = Allocation(
            self.cfg.mixture,
            [len(p) for p in self.train_set.parts],
            self.cfg.batch_size * world * accumulate,
            self.cfg.on_exhausted,
            self.phases,
            self.cfg.seq_len,
        )
        sampler = MixtureSampler(
            self.allocation,
            self.train_set.offsets,
            self.cfg.batch_size,
            seed=self.cfg.seed,
            start_step=trainer.global_step if trainer else 0,
            accumulate=accumulate,
            world_size=world,
            rank=trainer.global_rank if trainer else 0,
            skips=self.skip_windows,
        )
        for name, step in self.allocation.exhausted.items():
            log.warning(
                "data.mixture: source '%s' reaches its max_epochs at step %d; the others share its weight",
                name,
                step,
            )
        # The cap's step is set here, not at setup: skipped windows move it, and SpikeGuard hands them over
        # only after the checkpoint restore; before fit no manifest has sized the sources to say it earlier.
        if trainer is not None and self.allocation.stop_step is not None:
            stop = optimizer_step(sampler, self.allocation.stop_step)
            if trainer.max_steps == -1 or stop < trainer.max_steps:
                log.warning(
                    "data.mixture: a source reaches its max_epochs at step %d: training stops there", stop
                )
                trainer.fit_loop.epoch_loop.max_steps = stop
        return self._loader(self.train_set, batch_sampler=sampler)

    def val_batch_list(self) -> list[list[int]]:
        if self.val_set is None:
            self.setup("validate")
        trainer = self.trainer
        batches, self.val_sources = mixed_val_batches(
            [len(p) for p in self.val_set.parts],
            [s.weight for s in self.cfg.mixture],
            self.cfg.batch_size,
            world_size=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
        )
        return batches

    def val_source(self, batch_idx: int) -> str | None:
        """Name of the source validation batch `batch_idx` holds (its loss is logged as val/loss/<name>)."""
        return self.cfg.mixture[self.val_sources[batch_idx]].name


def optimizer_step(sampler: StepSampler, stream_step: int) -> int:
    """The first optimizer step that trains on stream step `stream_step` or later (skipped windows shift it)."""
    step = max(0, stream_step - sum(last - first + 1 for first, last in sampler.skips))
    while sampler.stream_step(step) < stream_step:
        step += 1
    return step


def check_not_empty(name: str, folder: Path, manifest: dict, seq_len: int) -> None:
    """Refuse a source without one training and one validation window, naming it."""
    for split in ("train", "val"):
        tokens = manifest["splits"][split]["tokens"]
        if tokens < seq_len + 1:
            raise Refused(
                f"data.mixture source '{name}' ({folder}) has {tokens} {split} tokens, fewer than one window of "
                f"data.seq_len+1={seq_len + 1}: give it more data, or leave it out of data.mixture"
            )


def check_one_tokenizer(names: list[str], folders: list[Path], manifests: list[dict]) -> None:
    """Refuse sources tokenized differently: the same id would mean different strings in each."""
    first = manifests[0]["tokenizer_sha256"]
    for name, folder, manifest in zip(names[1:], folders[1:], manifests[1:]):
        if manifest["tokenizer_sha256"] != first:
            raise Refused(
                f"data.mixture sources '{names[0]}' and '{name}' were tokenized differently: '{names[0]}' "
                f"({folders[0]}) by tokenizer sha256 {first}, '{name}' ({folder}) by sha256 "
                f"{manifest['tokenizer_sha256']}. Prepare every source with one tokenizer: `lm prepare ... "
                f"data.tokenizer={folders[0] / 'tokenizer.json'}`"
            )


@dataclass(frozen=True)
class SourceShare:
    """What a plan draws from one source, for the doctor's table."""

    name: str
    tokens: int | None
    """Training tokens the source holds; None while it is not prepared."""
    planned: int
    """Tokens the plan draws from it (its windows x seq_len)."""
    epochs: float | None
    """Passes over its training windows; None while it is not prepared."""
    capped_at: int | None
    """Step at which its max_epochs cap stops the run or takes it out of the mixture; None: never."""


def plan_sources(
    cfg: DataConfig, phases: Sequence[PhaseConfig], per_step: int, steps: int
) -> list[SourceShare] | None:
    """Each source's share of a plan of `steps` optimizer steps of `per_step` windows, read from the prepared
    manifests without tokenizing anything; None while a source is not prepared (its size is unknown)."""
    manifests = []
    for source in mixture_sources(cfg, train=False) or [None]:
        folder = prepared_folder(source) if source is not None else None
        if folder is None or not (folder / "manifest.json").is_file():
            return None
        manifests.append(load_manifest(folder))
    tokens = [m["splits"]["train"]["tokens"] for m in manifests]
    windows = [max(1, (n - 1) // cfg.seq_len) for n in tokens]
    allocation = Allocation(cfg.mixture, windows, per_step, cfg.on_exhausted, phases, cfg.seq_len)
    counts = allocation.counts_at(
        min(steps, allocation.stop_step) if allocation.stop_step is not None else steps
    )
    return [
        SourceShare(
            s.name,
            tokens[k],
            int(counts[k]) * cfg.seq_len,
            counts[k] / windows[k],
            allocation.capped_at(s.name, steps),
        )
        for k, s in enumerate(cfg.mixture)
    ]


# -- preflight: the doctor's mixture check (lm.run.doctor runs it) --------------------------------------


def mixture_findings(data: DataConfig, phases: Sequence[PhaseConfig], plan: RunPlan) -> list[Finding]:
    """Per source of data.mixture: tokens held against tokens the plan draws (weight x plan), the epochs that
    makes, and where a max_epochs cap will stop the run or leave the source out (lm.data.mixture)."""
    if not data.mixture:
        return []
    end = plan.end
    per_step = plan.tokens_per_step // data.seq_len
    steps = plan.end_steps
    rows = plan_sources(data, phases, per_step, steps)
    if rows is None:
        return [
            Finding(
                "mixture", "ok", f"{len(data.mixture)} sources, not all prepared yet: checked once they are"
            )
        ]
    findings = []
    for row in rows:
        what = (
            f"{row.name}: {row.tokens:,} tokens held, the plan draws {row.planned:,} "
            f"({row.planned / max(end.tokens, 1):.0%} of {end.tokens:,}) = {row.epochs:.2f} epochs"
        )
        if row.capped_at is not None:
            outcome = "the run stops" if data.on_exhausted == "stop" else "the others take its weight"
            fix = f"raise its max_epochs, lower its weight{' or data.on_exhausted=renormalise' if data.on_exhausted == 'stop' else ''}"
            findings.append(
                Finding(
                    "mixture",
                    "warn",
                    f"{what}; its max_epochs cap is met at step {row.capped_at:,}: {outcome}",
                    "the plan as written",
                    fix,
                )
            )
        elif row.epochs > 1:
            findings.append(
                Finding(
                    "mixture",
                    "warn",
                    f"{what}: repeated data",
                    "fresh tokens",
                    "give it more data, lower its weight or set its max_epochs",
                )
            )
        else:
            findings.append(Finding("mixture", "ok", what))
    return findings
