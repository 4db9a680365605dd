"""Data pipeline tests on a small slice of the real stdlib corpus with real tokenizers."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import signal
import time
from itertools import islice
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lm.base.exits import EXIT_CONFIG, Refused, exit_code
from lm.data import (
    EOT,
    DataConfig,
    LMDataModule,
    StepSampler,
    TokenWindows,
    dataset_dir,
    load_manifest,
    load_tokenizer,
    prepare,
    shard_paths,
    stdlib_documents,
)
from lm.data.manifest import VERIFIED, NotPrepared, verify_shards
from lm.data.stdlib import list_files, select_files
from lm.data.tokenizer import file_sha256

SMALL = dict(max_bytes=1_500_000, vocab_size=512, seq_len=64, tokenizer_sample_bytes=500_000, batch_size=8)
TINY = dict(max_bytes=200_000, vocab_size=300, seq_len=32, tokenizer_sample_bytes=100_000)


@pytest.fixture(scope="session")
def cfg(tmp_path_factory) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache")), num_workers=0, **SMALL)


@pytest.fixture(scope="session")
def data_dir(cfg) -> Path:
    return prepare(cfg)


@pytest.fixture(scope="session")
def manifest(data_dir) -> dict:
    return load_manifest(data_dir)


def tokens(data_dir: Path, split: str, manifest: dict) -> np.ndarray:
    """The split's whole token stream: its shards concatenated in manifest order."""
    return np.concatenate([np.fromfile(p, manifest["dtype"]) for p in shard_paths(data_dir, manifest, split)])


def test_prepare_is_cached(cfg, data_dir):
    stamps = {p.name: p.stat().st_mtime_ns for p in data_dir.iterdir()}
    t0 = time.perf_counter()
    assert prepare(cfg) == data_dir
    assert time.perf_counter() - t0 < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in data_dir.iterdir()} == stamps
    assert sorted(stamps) == [
        "manifest.json",
        "progress",
        "tokenizer.json",
        "train-00000.bin",
        "val-00000.bin",
    ]
    assert not [p for p in data_dir.parent.iterdir() if ".tmp-" in p.name], "temporary folder left behind"


def test_interrupted_prepare_is_not_trusted(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path), **TINY)
    final = dataset_dir(cfg)
    # What a killed run leaves: a half-written build folder, and (worse) a final folder with no manifest.
    stale = final.parent / f".{final.name}.tmp-dead"
    stale.mkdir(parents=True)
    (stale / "train-00000.bin").write_bytes(b"\0" * 10)
    (stale / "manifest.json").write_text("{}")
    final.mkdir()
    (final / "train-00000.bin").write_bytes(b"\0" * 10)

    assert prepare(cfg) == final
    manifest = load_manifest(final)
    assert manifest["splits"]["train"]["tokens"] > 1000
    assert len(list(tmp_path.iterdir())) == 2, "only the stale folder and the dataset should be there"


def test_manifest_matches_files(data_dir, manifest):
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 512
    for split in ("train", "val"):
        info = manifest["splits"][split]
        assert sum(p.stat().st_size for p in shard_paths(data_dir, manifest, split)) == info["tokens"] * 2
        assert info["tokens"] == sum(s["tokens"] for s in info["shards"])
        assert info["documents"] == len(manifest["documents"][split]) > 0
    # Only empty __init__.py files: the non-UTF-8 stdlib fixtures are outside this small slice.
    assert {s["reason"] for s in manifest["skipped"]} <= {"empty"}


def test_ids_in_range_and_documents_separated(data_dir, manifest):
    eot = manifest["eot_id"]
    assert load_tokenizer(data_dir).token_to_id(EOT) == eot
    for split in ("train", "val"):
        ids = tokens(data_dir, split, manifest)
        assert ids.max() < manifest["vocab_size"]
        assert ids[-1] == eot
        assert (ids == eot).sum() == manifest["splits"][split]["documents"]
        assert not np.any((ids[1:] == eot) & (ids[:-1] == eot)), "empty documents should be skipped"


def test_tokenizer_round_trips_source_text(data_dir):
    tok = load_tokenizer(data_dir)
    docs = stdlib_documents(max_bytes=300_000).documents[:20]
    texts = [d.text for d in docs] + ["naïve café ✓ 数据 🐍\r\n\ttab  spaces\x00", EOT]
    tok.encode_special_tokens = True  # as when the shards are written: a literal EOT string is text
    for text in texts:
        assert tok.decode(tok.encode(text).ids) == text


def test_splits_are_disjoint_and_complete(cfg, data_dir, manifest):
    names = manifest["documents"]
    assert not set(names["train"]) & set(names["val"])
    texts = {d.name: d.text for d in stdlib_documents(cfg.max_bytes).documents}
    assert sorted(names["train"] + names["val"]) == sorted(texts)

    # Decoding the train shards document by document gives back exactly the training documents, in order.
    tok = load_tokenizer(data_dir)
    ids = tokens(data_dir, "train", manifest)
    bounds = np.flatnonzero(ids == manifest["eot_id"])
    starts = np.concatenate([[0], bounds[:-1] + 1])
    decoded = tok.decode_batch([ids[s:e].tolist() for s, e in zip(starts, bounds)])
    assert decoded == [texts[n] for n in names["train"]]
    assert not {texts[n] for n in names["val"]} & set(decoded)


def test_max_bytes_picks_a_spread_of_whole_files():
    files = list_files()
    chosen = select_files(files, 1_000_000)
    sizes = dict(files)
    assert sum(sizes[n] for n in chosen) <= 1_000_000
    assert chosen == sorted(chosen)
    assert len({n.split("/")[0] for n in chosen if "/" in n}) >= 5, "expected files from many packages"


def take(sampler: StepSampler, n: int) -> list[list[int]]:
    return list(islice(iter(sampler), n))


def test_sampler_is_reproducible_per_seed():
    a = take(StepSampler(100, 8, seed=1), 30)
    assert a == take(StepSampler(100, 8, seed=1), 30)
    assert a != take(StepSampler(100, 8, seed=2), 30)


def test_sampler_resumes_exactly():
    accumulate, step = 2, 7
    full = take(StepSampler(37, 4, seed=3, accumulate=accumulate), 60)
    resumed = take(StepSampler(37, 4, seed=3, start_step=step, accumulate=accumulate), 60 - step * accumulate)
    assert resumed == full[step * accumulate :]  # spans several epoch boundaries (37 windows, 4 per batch)


def test_ranks_partition_each_epoch():
    n, batch, world = 48, 4, 2
    per_rank = n // (batch * world)
    for epoch in range(2):
        seen = []
        for rank in range(world):
            batches = take(StepSampler(n, batch, seed=0, world_size=world, rank=rank), per_rank * (epoch + 1))
            seen.append({i for b in batches[per_rank * epoch :] for i in b})
        assert not seen[0] & seen[1]
        assert seen[0] | seen[1] == set(range(n))


def test_every_window_once_per_epoch(data_dir, manifest, cfg):
    n = len(TokenWindows(shard_paths(data_dir, manifest, "train"), cfg.seq_len, manifest["dtype"]))
    batch = 7
    flat = [i for b in take(StepSampler(n, batch, seed=5), 3 * n // batch + 1) for i in b]
    epochs = [flat[e * n : (e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1]


def test_token_windows(data_dir, manifest, cfg):
    ds = TokenWindows(shard_paths(data_dir, manifest, "train"), cfg.seq_len, manifest["dtype"])
    ids = tokens(data_dir, "train", manifest)
    assert len(ds) == (len(ids) - 1) // cfg.seq_len
    first, last = ds[0], ds[len(ds) - 1]
    assert first.dtype == torch.int64 and first.shape == (cfg.seq_len + 1,)
    assert first.tolist() == ids[: cfg.seq_len + 1].tolist()
    assert ds[1][0] == first[-1], "consecutive windows share their boundary token"
    assert last.shape == (cfg.seq_len + 1,)
    with pytest.raises(IndexError):
        ds[len(ds)]

    state = pickle.dumps(ds)
    assert len(state) < 1000, "the memory map must not be pickled"
    assert torch.equal(pickle.loads(state)[3], ds[3])


def test_token_windows_in_worker_processes(data_dir, manifest, cfg, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    ds = TokenWindows(shard_paths(data_dir, manifest, "train"), cfg.seq_len, manifest["dtype"])
    ds[0]  # opens the map in the parent, as Lightning's sanity checks may
    sampler = StepSampler(len(ds), 4, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2)
    for batch, indices in zip(islice(loader, 6), take(sampler, 6)):
        assert torch.equal(batch, torch.stack([ds[i] for i in indices]))


def test_datamodule_batches(cfg, data_dir, manifest):
    dm = LMDataModule(cfg)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.data_dir == data_dir
    assert dm.vocab_size == 512 and dm.eot_id == manifest["eot_id"]
    assert dm.tokenizer.get_vocab_size() <= dm.vocab_size
    train = next(iter(dm.train_dataloader()))
    assert train.shape == (cfg.batch_size, cfg.seq_len + 1) and train.dtype == torch.int64
    val = list(dm.val_dataloader())
    assert all(b.dtype == torch.int64 and b.shape[1] == cfg.seq_len + 1 for b in val)
    assert sum(len(b) for b in val) == len(dm.val_set)
    assert torch.equal(val[0][0], dm.val_set[0]), "validation is sequential"


def test_loader_workers_leave_stop_signals_to_the_trainer(cfg, data_dir):
    # A reclaim signals every process; a worker that died of it would fail the step before the save.
    dm = LMDataModule(dataclasses.replace(cfg, num_workers=2, persistent_workers=False))
    dm.prepare_data()
    dm.setup("fit")
    batches = iter(dm.val_dataloader())
    workers = batches._workers
    assert len(workers) == 2
    for _ in workers:  # batches come round-robin: once each worker has sent one, its worker_init_fn ran
        next(batches)
    for w in workers:
        os.kill(w.pid, signal.SIGTERM)
        os.kill(w.pid, signal.SIGUSR1)
    time.sleep(0.5)
    assert all(w.is_alive() for w in workers)
    assert sum(1 for _ in batches) >= 0  # the remaining batches still come


def test_truncated_bin_is_reported(data_dir, tmp_path):
    copy = tmp_path / data_dir.name
    shutil.copytree(data_dir, copy)
    with open(copy / "train-00000.bin", "r+b") as f:
        f.truncate(os.path.getsize(copy / "train-00000.bin") - 100)
    with pytest.raises(Refused, match=r"train-00000\.bin has .* bytes .* truncated .* delete"):
        load_manifest(copy)


def damaged_copy(data_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the prepared folder whose first training shard has out-of-vocabulary ids over every 50th
    token: the same size, so only a hash (or reading the ids) tells."""
    copy = Path(shutil.copytree(data_dir, tmp_path / data_dir.name))
    shard = copy / "train-00000.bin"
    ids = np.fromfile(shard, np.uint16)
    ids[::50] = 65000
    ids.tofile(shard)
    return copy, shard


def test_a_same_size_corrupt_shard_is_refused_by_its_hash(data_dir, tmp_path):
    copy, shard = damaged_copy(data_dir, tmp_path)
    manifest = load_manifest(copy)  # sizes only: it passes
    for mode in ("cached", "full"):
        with pytest.raises(Refused, match=rf"{shard} does not match the sha256 .* rerun `lm prepare`"):
            verify_shards(copy, manifest, mode)
    verify_shards(copy, manifest, "size")  # the per-window check is what is left (below)


def test_a_manifest_that_does_not_match_its_shards_is_refused(data_dir, tmp_path):
    copy = Path(shutil.copytree(data_dir, tmp_path / data_dir.name))
    manifest = load_manifest(copy)
    manifest["splits"]["val"]["shards"][0]["sha256"] = "0" * 64
    with pytest.raises(Refused, match=r"val-00000\.bin does not match the sha256"):
        verify_shards(copy, manifest, "cached")


def test_ids_outside_the_vocabulary_are_refused_naming_the_shard(data_dir, tmp_path):
    copy, shard = damaged_copy(data_dir, tmp_path)
    manifest = load_manifest(copy)
    manifest["splits"]["train"]["shards"][0]["sha256"] = file_sha256(shard)  # a consistent, wrong manifest
    with pytest.raises(Refused, match=rf"{shard} holds token id 65000, outside the vocabulary of 512"):
        verify_shards(copy, manifest, "full")
    # Unverified (data.verify=size), the window that holds one is refused when it is read, never an IndexError.
    windows = TokenWindows([shard], 64, manifest["dtype"], vocab_size=manifest["vocab_size"])
    with pytest.raises(Refused, match=rf"{shard} holds token id 65000 at or above the vocabulary size 512"):
        windows[0]


def test_cached_verification_reads_a_shard_once_until_it_changes(data_dir, tmp_path):
    copy = Path(shutil.copytree(data_dir, tmp_path / data_dir.name))
    manifest = load_manifest(copy)
    verify_shards(copy, manifest, "cached")
    record = json.loads((copy / VERIFIED).read_text())
    assert set(record) == {s["file"] for sp in ("train", "val") for s in manifest["splits"][sp]["shards"]}
    # Damage a shard but keep its size and mtime: `cached` trusts its record (no read), `full` reads it.
    shard = copy / "train-00000.bin"
    stat = shard.stat()
    ids = np.fromfile(shard, np.uint16)
    ids[0] = ids[1]
    ids.tofile(shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    verify_shards(copy, manifest, "cached")
    with pytest.raises(Refused, match="does not match the sha256"):
        verify_shards(copy, manifest, "full")
    shard.touch()  # a new mtime: `cached` reads the shard again
    with pytest.raises(Refused, match="does not match the sha256"):
        verify_shards(copy, manifest, "cached")


def test_a_folder_without_a_manifest_is_a_refusal_naming_it(data_dir, tmp_path):
    copy = Path(shutil.copytree(data_dir, tmp_path / data_dir.name))
    (copy / "manifest.json").unlink()
    with pytest.raises(NotPrepared, match=rf"no manifest\.json in {copy}.*run `lm prepare` first") as err:
        load_manifest(copy)
    assert exit_code(err.value) == EXIT_CONFIG


def test_the_data_module_refuses_damaged_data_before_training(cfg, data_dir, tmp_path):
    copy, shard = damaged_copy(data_dir, tmp_path)
    tokens = dataclasses.replace(cfg, source="tokens", dir=str(copy))
    with pytest.raises(Refused, match=rf"{shard} does not match the sha256"):
        LMDataModule(tokens).check_prepared()
    intact = Path(shutil.copytree(data_dir, tmp_path / "intact"))
    LMDataModule(dataclasses.replace(tokens, dir=str(intact))).check_prepared()  # it passes, and is recorded
    assert (intact / VERIFIED).is_file()


def test_seq_len_longer_than_split(data_dir, manifest):
    n = manifest["splits"]["val"]["tokens"]
    with pytest.raises(Refused, match=rf"val-00000\.bin has {n} tokens.*lower data\.seq_len"):
        TokenWindows(shard_paths(data_dir, manifest, "val"), n, manifest["dtype"])


def test_config_errors(cfg):
    with pytest.raises(Refused, match="data.source 'foo' is unknown"):
        prepare(dataclasses.replace(cfg, source="foo"))
    with pytest.raises(Refused, match="data.val_fraction"):
        prepare(dataclasses.replace(cfg, val_fraction=0.0))
    with pytest.raises(Refused, match="data.vocab_size=100 is too small"):
        prepare(dataclasses.replace(cfg, vocab_size=100))


class BatchRecorder(pl.LightningModule):
    """Smallest trainable model that remembers every training batch it was given."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab_size, 8)
        self.head = torch.nn.Linear(8, vocab_size)
        self.seen: list[torch.Tensor] = []

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(batch[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.clone())
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    cfg: DataConfig, max_steps: int, ckpt: Path | None = None, resume: Path | None = None
) -> BatchRecorder:
    dm = LMDataModule(cfg)
    model = BatchRecorder(dm.vocab_size)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=-1,
        max_steps=max_steps,
        accumulate_grad_batches=2,
        val_check_interval=4,
        limit_val_batches=2,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=resume)
    if ckpt:
        trainer.save_checkpoint(ckpt)
    return model


def test_lightning_resume_sees_the_same_batches(cfg, data_dir, tmp_path):
    full = fit(cfg, max_steps=6).seen
    fit(cfg, max_steps=3, ckpt=tmp_path / "step3.ckpt")
    resumed = fit(cfg, max_steps=6, resume=tmp_path / "step3.ckpt").seen
    assert len(full) == 12 and len(resumed) == 6  # 2 micro-batches per optimizer step
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[6:]))


def test_default_cache_dir_resolves_without_hydra(tmp_path, monkeypatch):
    monkeypatch.setenv("LM_CACHE", str(tmp_path))
    assert dataset_dir(DataConfig()).parent == tmp_path


def test_a_trained_tokenizer_ends_documents_with_data_eot_token(tmp_path):
    """data.eot_token names the separator of a trained tokenizer too (it used to be ignored: the trained
    tokenizer always had <|endoftext|>, and preparation then refused its own tokenizer)."""
    cfg = DataConfig(cache_dir=str(tmp_path), num_workers=0, eot_token="<|eot|>", **TINY)
    folder = prepare(cfg)
    manifest = load_manifest(folder)
    tok = load_tokenizer(folder)
    assert manifest["eot_token"] == "<|eot|>" and tok.token_to_id("<|eot|>") == manifest["eot_id"] == 0
    assert tok.token_to_id(EOT) is None
    ids = tokens(folder, "train", manifest)
    assert (ids == 0).sum() == manifest["splits"]["train"]["documents"]
