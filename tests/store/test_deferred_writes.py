"""While a run trains, a run file that cannot be written is kept as rank 0's vote, never raised on one rank."""

import errno
import os
from pathlib import Path

import pytest

from lm.base.exits import DiskFull
from lm.store import atomic
from lm.store.tensorboard_layout import KeptWrites


def unwritable(monkeypatch) -> None:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, "fsync", full)


def test_a_failed_write_is_kept_while_deferred_and_raised_otherwise(tmp_path, monkeypatch):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "other"
    (run_dir / "ledger.json").parent.mkdir()
    atomic.write_atomic(run_dir / "ledger.json", "old")
    unwritable(monkeypatch)
    atomic.defer(run_dir)
    try:
        atomic.write_atomic(run_dir / "ledger.json", "new")  # kept, not raised
        atomic.append_atomic(run_dir / "samples.jsonl", "{}\n")
        first = atomic.deferred(run_dir)
        assert isinstance(first, DiskFull) and "ledger.json" in str(first)
        assert (run_dir / "ledger.json").read_text() == "old"  # the previous version intact
        with pytest.raises(DiskFull):  # another folder is not deferred
            atomic.write_atomic(elsewhere / "x.json", "new")
    finally:
        assert atomic.undefer(run_dir) is first
    assert atomic.deferred(run_dir) is None
    with pytest.raises(DiskFull):
        atomic.write_atomic(run_dir / "ledger.json", "new")


def test_tensorboards_writes_are_kept_as_well(tmp_path):
    class Writer:
        def add_scalar(self, *args):
            raise FileNotFoundError(errno.ENOENT, "the run directory went", str(tmp_path / "tb" / "events"))

    writer = KeptWrites(Writer(), str(tmp_path / "tb"))
    with pytest.raises(FileNotFoundError):
        writer.add_scalar("train/loss", 1.0, 1)
    atomic.defer(Path(tmp_path))
    try:
        assert writer.add_scalar("train/loss", 1.0, 1) is None
        assert isinstance(atomic.deferred(tmp_path), FileNotFoundError)
    finally:
        atomic.undefer(tmp_path)
