"""LightningDataModule that prepares the cached dataset and serves step-addressed training batches."""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.config import DataConfig
from lm.data.dataset import StepSampler, TokenWindows, val_batches
from lm.data.manifest import (
    MANIFEST,
    check_tokenizer,
    implied_epochs,
    load_manifest,
    prepared_folder,
    shard_paths,
    verify_shards,
)
from lm.data.shards import prepare
from lm.data.tokenizer import load_tokenizer
from lm.numbers.batch_ramp import ramp_of

log = logging.getLogger("lm.data")


class LMDataModule(pl.LightningDataModule):
    """Batches of (batch_size, seq_len + 1) int64 token windows from a prepared dataset.

    Training order depends only on (seed, trainer.global_step, skip_windows), so a resumed run continues with
    exactly the batches an uninterrupted run would have seen. Configure the Trainer with `use_distributed_sampler=False`
    (ranks are split by the sampler) and step-based limits, since the training loader is infinite.
    """

    def __init__(self, cfg: DataConfig, planned_tokens: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.planned_tokens = planned_tokens
        """Tokens the whole plan trains on (lm.numbers.run_plan.plan_end), for the repeated-data warning; None: no check."""
        self._data_dir: Path | None = None
        self._manifest: dict | None = None
        self._tokenizer: Tokenizer | None = None
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self.skip_windows: list[tuple[int, int]] = []
        """Data windows [first, last] (steps) that rollbacks after loss spikes skip; set by the SpikeGuard
        callback after setup and the checkpoint restore, before the training loader is built."""

    def prepare_data(self) -> None:
        """Tokenize and cache the corpus (Lightning runs this on one process per node); a no-op once
        `check_prepared` found and verified it (its "using the prepared dataset" line printed once)."""
        if self._manifest is None:
            prepare(self.cfg)

    def setup(self, stage: str | None = None) -> None:
        """Open the prepared dataset; cheap, since `prepare` returns the cached folder."""
        manifest, folder = self.manifest, self.data_dir
        dtype, vocab = manifest["dtype"], manifest["vocab_size"]
        self.train_set = TokenWindows(shard_paths(folder, manifest, "train"), self.cfg.seq_len, dtype, vocab)
        self.val_set = TokenWindows(shard_paths(folder, manifest, "val"), self.cfg.seq_len, dtype, vocab)

    def check_prepared(self) -> None:
        """Open and verify the dataset now if it is prepared already (data=tokens, or a complete cache
        folder), so bad data is refused before the run directory changes; data still to be prepared is
        verified once `prepare_data` has written it."""
        if prepared_folder(self.cfg) is not None:
            self._resolve()

    def _resolve(self) -> None:
        if self._manifest is not None:
            return
        data_dir = prepare(self.cfg)
        manifest = load_manifest(data_dir)
        check_tokenizer(self.cfg, data_dir, manifest)
        verify_shards(data_dir, manifest, self.cfg.verify)
        if manifest["vocab_size"] > self.cfg.vocab_size:
            raise Refused(
                f"{data_dir} was tokenized with vocab_size={manifest['vocab_size']} but data.vocab_size="
                f"{self.cfg.vocab_size}; ids would overflow the embedding: set data.vocab_size="
                f"{manifest['vocab_size']} (the model is sized from it)"
            )
        self._data_dir, self._manifest = data_dir, manifest

    @property
    def data_dir(self) -> Path:
        """Folder of the prepared dataset (tokenizer.json, train-*.bin, val-*.bin, manifest.json)."""
        self._resolve()
        return self._data_dir

    @property
    def manifest(self) -> dict:
        """The validated manifest.json of the prepared dataset."""
        self._resolve()
        return self._manifest

    @property
    def vocab_size(self) -> int:
        """Size of the id space (every id is below it); size the model's embedding from this."""
        return self.manifest["vocab_size"]

    @property
    def eot_id(self) -> int:
        """Id of the end-of-text token that follows every document."""
        return self.manifest["eot_id"]

    @property
    def tokenizer(self) -> Tokenizer:
        """The trained tokenizer, for decoding samples or encoding prompts."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.data_dir)
        return self._tokenizer

    def _loader(self, dataset: TokenWindows, **kwargs) -> DataLoader:
        workers = self.cfg.num_workers
        if workers > 0:
            # Forked workers never tokenize; saying so up front silences the Rust pool's fork warning.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return DataLoader(
            dataset,
            num_workers=workers,
            pin_memory=self.cfg.pin_memory and torch.cuda.is_available(),
            persistent_workers=self.cfg.persistent_workers and workers > 0,
            worker_init_fn=ignore_stop_signals if workers > 0 else None,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        """Infinite loader whose batches continue from the trainer's current optimizer step."""
        if self.train_set is None:
            self.setup("fit")
        trainer = self.trainer
        if self.planned_tokens:
            epochs = implied_epochs(self.manifest, self.planned_tokens)
            if epochs > 1:
                log.warning(
                    "the plan trains on %.3g tokens, %.2f epochs of the %d training tokens in %s: repeated data",
                    self.planned_tokens, epochs, self.manifest["splits"]["train"]["tokens"], self.data_dir,
                )  # fmt: skip
        accumulate = trainer.accumulate_grad_batches if trainer else 1
        world = trainer.world_size if trainer else 1
        sampler = StepSampler(
            len(self.train_set),
            self.cfg.batch_size,
            seed=self.cfg.seed,
            start_step=trainer.global_step if trainer else 0,
            accumulate=accumulate,
            world_size=world,
            rank=trainer.global_rank if trainer else 0,
            skips=self.skip_windows,
            ramp=ramp_of(self.cfg, accumulate, world),
        )
        return self._loader(self.train_set, batch_sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        """The validation windows in order, split across ranks as one process with the global batch sees them."""
        batches = self.val_batch_list()
        return self._loader(self.val_set, batch_sampler=batches)

    def val_batch_list(self) -> list[list[int]]:
        """This rank's validation batches (window indices), in order; `val/loss` and the phase table read them."""
        if self.val_set is None:
            self.setup("validate")
        trainer = self.trainer
        return val_batches(
            len(self.val_set),
            self.cfg.batch_size,
            world_size=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
        )

    def val_source(self, batch_idx: int) -> str | None:
        """Name of the corpus validation batch `batch_idx` comes from, for `val/loss/<name>`: None with one
        corpus (a mixture names its sources)."""
        return None


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers leave stop signals to the trainer, whenever they were started, and die with it.

    A spot reclaim or `kill -- -PGID` signals every process; a worker that dies of it fails the step before
    the trainer can save. The trainer stops its workers itself; because SIGTERM cannot, a worker is killed by
    the kernel when the trainer exits (PR_SET_PDEATHSIG), so a trainer ended any way (its exit bound, SIGKILL)
    leaves no worker behind holding the run's lock or memory.
    Lightning's own per-worker seeding (`seed_everything(workers=True)`) runs as it would without us.
    """
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    if sys.platform.startswith("linux"):  # elsewhere torch's worker watchdog notices a gone parent within 5 s
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.environ.get("PL_SEED_WORKERS") == "1":
        pl_worker_init_function(worker_id)


# -- preflight: the doctor's DataLoader checks (lm.run.doctor runs them) ----------------------------------


def worker_findings(data: DataConfig, cuda: bool) -> list[Finding]:
    """num_workers=0 on a GPU stalls the device while the next batch loads."""
    if not cuda:
        return []
    if data.num_workers == 0:
        n = max(1, min(4, (os.cpu_count() or 2) - 1))
        return [
            Finding(
                "num_workers",
                "warn",
                "data.num_workers=0: the GPU idles while each batch loads",
                "seed 000: 'massive' (est. 5-30% tokens/s)",
                f"data.num_workers={n}",
            )
        ]
    return [Finding("num_workers", "ok", f"{data.num_workers} DataLoader workers")]


def prepared_dataset(data: DataConfig) -> TokenWindows | None:
    """The training split's Dataset if the data is prepared already, else None. Preflight stays cheap and
    offline: it never tokenizes, and never lists a Hugging Face dataset (`prepared_folder`)."""
    folder = prepared_folder(data)
    if folder is None or not (folder / MANIFEST).is_file():
        return None
    manifest = load_manifest(folder)
    return TokenWindows(shard_paths(folder, manifest, "train"), data.seq_len, manifest["dtype"])


def pickle_findings(data: DataConfig, dataset=None) -> list[Finding]:
    """What the DataLoader sends to its worker processes must pickle (and still work once unpickled)."""
    if data.num_workers == 0:
        return []
    if dataset is None:
        try:
            dataset = prepared_dataset(data)
        except (OSError, Refused) as e:  # a data problem, not a pickling one: preparation reports it
            log.debug("doctor: prepared dataset not located (%s)", e)
    try:
        if dataset is None:  # not prepared yet: the data module is what carries the config to them
            pickle.loads(pickle.dumps(LMDataModule(data)))
            return [Finding("pickle", "ok", "data module pickles (data not prepared yet: dataset unchecked)")]
        copy = pickle.loads(pickle.dumps(dataset))
        if len(copy):
            copy[0]  # a worker's first read: re-opens the shards from the unpickled paths
        return [Finding("pickle", "ok", f"dataset pickles for {data.num_workers} workers")]
    except Exception as e:  # anything pickling raises: lambdas, open handles, locks
        return [
            Finding(
                "pickle",
                "error",
                f"the dataset cannot be sent to worker processes: {type(e).__name__}: {e}",
                "no crash in the first DataLoader worker",
                "data.num_workers=0 (slow) or make the dataset picklable",
            )
        ]
