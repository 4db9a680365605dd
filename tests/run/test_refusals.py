"""Refusals (exit 78) happen before anything in the run directory changes, as real `python train.py` processes.

One run is trained once; every refused command then targets it, and the run directory (every file with its
size and modification time, every folder) must be exactly as it was.
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lm.base.exits import EXIT_CONFIG
from lm.config import compose, to_objects
from lm.data.manifest import dataset_dir

from ..conftest import CONF, TINY
from ..conftest import train_in_process as train
from ..harness import command, fault

ROOT = CONF.parent
RUN = ["run.name=r", "trainer.max_steps=2", "trainer.val_every_steps=2", "trainer.limit_val_batches=1"]


def snapshot(folder: Path) -> dict[str, tuple[int, int] | None]:
    """Every file under `folder` with its size and mtime (ns); every folder by its path."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_cache) -> list[str]:
    """The overrides of a finished tiny run (its run directory is `<run.root>/r`)."""
    root = tmp_path_factory.mktemp("refusals")
    args = [*TINY, f"run.root={root}", f"data.cache_dir={data_cache}", *RUN]
    assert train(args) == 0
    return args


def run_dir(args: list[str]) -> Path:
    return Path(next(a for a in args if a.startswith("run.root=")).split("=", 1)[1]) / "r"


def prepared_copy(run: list[str], tmp_path: Path) -> Path:
    """A copy of the dataset folder the run trained on, to damage."""
    return Path(shutil.copytree(dataset_dir(to_objects(compose(run)).data), tmp_path / "tokens"))


def train_process(args: list[str], supervised: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(command(args, supervised), cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=0", "trainer.max_steps=0 must be a positive number of optimizer steps"),
        ("trainer.max_steps=-5", "trainer.max_steps=-5 must be a positive"),
        ("trainer.val_every_steps=0", "trainer.val_every_steps=0 must be a positive"),
        ("data.batch_size=0", "data.batch_size=0 must be >= 1"),
        ("model.max_seq_len=32", "model.max_seq_len=32 is shorter than data.seq_len=64"),
        ("model.n_layr=3", "Key 'n_layr' not in 'ModelConfig'"),  # Hydra's own compose errors
        ("trainer.max_steps=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
    ],
)
def test_a_refused_config_exits_78_and_leaves_the_run_directory_as_it_was(run, override, message):
    before = snapshot(run_dir(run))
    result = train_process([*run, override])
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert snapshot(run_dir(run)) == before


def test_a_refused_new_run_leaves_no_run_directory(run):
    result = train_process([*run, "run.name=fresh", "trainer.max_steps=0"])
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    assert not (run_dir(run).parent / "fresh").exists()


def corrupt_same_size(folder: Path) -> str:
    """Out-of-vocabulary ids written over every 50th token of the first training shard: the size is intact."""
    shard = folder / "train-00000.bin"
    ids = np.fromfile(shard, np.uint16)
    ids[::50] = 65000
    ids.tofile(shard)
    return shard.name


def wrong_sha(folder: Path) -> str:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["sha256"] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return "train-00000.bin"


def no_manifest(folder: Path) -> str:
    (folder / "manifest.json").unlink()
    return "no manifest.json in"


@pytest.mark.parametrize(
    ("damage", "fix"),
    [
        (corrupt_same_size, "does not match the sha256 its manifest records"),
        (wrong_sha, "does not match the sha256 its manifest records"),
        (no_manifest, "run `lm prepare` first"),
    ],
)
def test_damaged_prepared_data_exits_78_before_the_run_directory_changes(run, tmp_path, damage, fix):
    folder = prepared_copy(run, tmp_path)
    named = damage(folder)
    before = snapshot(run_dir(run))
    result = train_process([*run, "data=tokens", f"data.dir={folder}", "data.vocab_size=512"])
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    assert named in result.stderr and fix in result.stderr and "Traceback" not in result.stderr
    # Hydra's hydra/<time>/ of the refused invocation is gone again; every file is as it was.
    assert snapshot(run_dir(run)) == before


def test_out_of_vocabulary_ids_are_refused_even_unverified(run, tmp_path):
    folder = prepared_copy(run, tmp_path)
    corrupt_same_size(folder)
    args = [*run, "run.name=unverified", "data=tokens", f"data.dir={folder}", "data.vocab_size=512"]
    result = train_process([*args, "data.verify=size"])  # read by the DataLoader's worker processes
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    assert "train-00000.bin holds token id 65000 at or above the vocabulary size 512" in result.stderr
    assert "IndexError" not in result.stderr


def test_supervise_stops_at_once_on_a_config_typo(run):
    result = train_process([*run, "model.n_layr=3"], supervised=True)
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    assert "not restarting" in result.stderr and "restart 1" not in result.stderr


def test_a_library_value_error_mid_run_is_a_crash_with_its_traceback_and_supervise_restarts_it(run, tmp_path):
    """A ValueError from a library (numpy, in a callback of one's own) at step 3 is a crash, not a refusal:
    exit 1 with its traceback (file and line), and `lm supervise` restarts it from the step-2 checkpoint."""
    args = [*run, "trainer.max_steps=4", "checkpoint.every_n_steps=2"]
    alone = [*args, "run.name=crash", *fault(tmp_path / "alone", "value_error", step=3)]
    (tmp_path / "alone").mkdir()
    result = train_process(alone)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback (most recent call last)" in result.stderr
    assert "ValueError: cannot reshape array of size 3 into shape (2,2)" in result.stderr
    assert 'tests/faults.py", line' in result.stderr  # where it was raised
    assert "train.py: cannot reshape" not in result.stderr  # not the one-line form of a refusal

    supervised = [*args, "run.name=crash-supervised", *fault(tmp_path / "supervised", "value_error", step=3)]
    (tmp_path / "supervised").mkdir()
    result = train_process(supervised, supervised=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "child left with exit 1" in result.stderr and "restart 1" in result.stderr
    assert "ValueError: cannot reshape" in result.stderr
    assert json.loads((run_dir(run).parent / "crash-supervised" / "cost.json").read_text())["step"] == 4
