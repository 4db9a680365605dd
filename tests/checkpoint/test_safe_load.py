"""Checkpoints load as data: a pickle that would run code is refused (exit 78) by name, wherever it is planted.

The payload is real: its `__reduce__` runs `touch <marker>`, and every test checks the marker never appears. It
is planted as an attacker with write access would plant it, into a file that is otherwise a real checkpoint of
a tiny run: as `last.ckpt`, as a step checkpoint a resume falls back to, in a sharded folder's `meta.pt` (and
its index, and a non-tensor item inside a shard), and in a `file://` bucket with its pointer rewritten to match.
A resume, `lm export`, `lm sample` and `lm eval` each refuse it and say what they refused. An old checkpoint
that holds a type beyond torch's allow-list is read through the documented opt-in, `LM_TRUST_CHECKPOINT`, and
the run's next save is plain data again.
"""

import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from lm.base.exits import EXIT_CONFIG, exit_code
from lm.checkpoint import files
from lm.checkpoint.files import TRUST_ENV, UnsafeCheckpoint
from lm.checkpoint.formats import SHARDED
from lm.checkpoint.local import AtomicCheckpointIO
from lm.checkpoint.remote import POINTER
from lm.cli import main as lm
from lm.config import register_configs
from lm.run.train import main

from ..conftest import CONF, TINY

RUN = [
    "trainer.max_steps=6",
    "checkpoint.every_n_steps=3",
    "trainer.val_every_steps=100",
    "trainer.limit_val_batches=1",
    "+trainer.extra.num_sanity_val_steps=0",
    "data.num_workers=0",
]
TASKS = Path(__file__).parents[1] / "fixtures" / "eval_tasks"


class Payload:
    """Unpickled, it runs a shell command that creates `marker`: what a planted checkpoint would do with the
    user's credentials."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def config(root: Path, data_cache: Path, name: str, *extra: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(
            "train",
            overrides=[
                *TINY,
                *RUN,
                f"run.root={root}",
                f"data.cache_dir={data_cache}",
                f"run.name={name}",
                *extra,
            ],
        )


@pytest.fixture(scope="module")
def reference(root, data_cache) -> Path:
    """A tiny run trained to step 6 (checkpoints at steps 3 and 6), copied by each test."""
    main(config(root, data_cache, "reference"))
    return root / "reference"


@pytest.fixture
def run(reference, tmp_path) -> Path:
    """A copy of the reference run (the test's to damage)."""
    copy = tmp_path / "runs" / "victim"
    shutil.copytree(reference, copy, symlinks=True)
    return copy


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "payload-ran"


def plant(path: Path, marker: Path) -> None:
    """Rewrite a real checkpoint file with the payload inside it (among the callbacks' states, where Lightning
    would hand it to a callback): a file that looks and loads like the run's own until it is unpickled."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    ckpt["callbacks"]["Innocent"] = {"state": Payload(marker)}
    path.unlink()
    torch.save(ckpt, path)


def resume(run: Path, data_cache: Path, *extra: str) -> BaseException | None:
    """Train the run on (to step 9) in this process; the exception it ended with, if any."""
    try:
        main(config(run.parent, data_cache, run.name, "trainer.max_steps=9", *extra))
    except BaseException as e:  # the refusal, or what a broken fix would raise
        return e
    return None


def assert_refused(error: BaseException | None, marker: Path, where: str) -> None:
    assert isinstance(error, UnsafeCheckpoint), error
    assert exit_code(error) == EXIT_CONFIG
    said = str(error)
    assert "posix.system" in said and where in said and TRUST_ENV in said, said
    assert not marker.exists()


def test_a_payload_as_last_ckpt_is_refused_by_the_resume_with_exit_78(run, marker, data_cache):
    plant(run / "checkpoints" / "step-6.ckpt", marker)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    # The command a user types, in its own process: exit 78 and the refusal on stderr, and nothing ran.
    overrides = [
        *TINY,
        *RUN,
        f"run.root={run.parent}",
        f"data.cache_dir={data_cache}",
        f"run.name={run.name}",
    ]
    done = subprocess.run(
        [sys.executable, str(CONF.parent / "train.py"), *overrides, "trainer.max_steps=9"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == EXIT_CONFIG, done.stderr[-3000:]
    assert "posix.system" in done.stderr and "step-6.ckpt" in done.stderr and "was not read" in done.stderr
    assert not marker.exists()
    # Refused, not taken for a broken file: nothing was set aside, the run did not fall back to step 3.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_a_payload_as_the_step_checkpoint_a_resume_falls_back_to_is_refused(run, marker, data_cache):
    ckpts = run / "checkpoints"
    (ckpts / "step-6.ckpt").write_bytes(b"truncated")  # the newest is broken: the resume falls back to step 3
    plant(ckpts / "step-3.ckpt", marker)
    assert_refused(resume(run, data_cache), marker, "step-3.ckpt")
    assert list((ckpts / "corrupt").iterdir())  # the broken one was set aside as before; the planted one not
    assert (ckpts / "step-3.ckpt").exists()


@pytest.mark.parametrize("verb", ["sample", "export", "eval"])
@pytest.mark.parametrize("planted", ["last", "step"])
def test_lm_sample_export_and_eval_refuse_a_payload(run, marker, tmp_path, capsys, verb, planted):
    plant(run / "checkpoints" / ("step-6.ckpt" if planted == "last" else "step-3.ckpt"), marker)
    path = run if planted == "last" else run / "checkpoints" / "step-3.ckpt"
    argv = {
        "sample": ["sample", str(path), "def", "--max-new-tokens", "4"],
        "export": ["export", str(path), "--out", str(tmp_path / "hf")],
        "eval": ["eval", str(path), "--tasks", "tiny_mc", "--include-path", str(TASKS)],
    }[verb]
    with pytest.raises(SystemExit) as stopped:
        lm(argv)
    assert stopped.value.code == EXIT_CONFIG
    said = capsys.readouterr().err
    assert f"lm {verb}: " in said and "posix.system" in said and "was not read" in said, said
    assert not marker.exists() and not (tmp_path / "hf").exists()


def sharded(run: Path) -> Path:
    """The run's step 6 rewritten as a sharded folder (what checkpoint.format=sharded writes), last.ckpt on it."""
    ckpts = run / "checkpoints"
    state = torch.load(ckpts / "step-6.ckpt", map_location="cpu", weights_only=True)
    (ckpts / "step-6.ckpt").unlink()
    AtomicCheckpointIO(fmt=SHARDED).save_checkpoint(state, ckpts / "step-6.ckpt")
    assert files.loadable(ckpts / "step-6.ckpt") is None
    return ckpts / "step-6.ckpt"


def test_a_payload_in_a_sharded_folders_meta_pt_is_refused_by_the_resume_and_lm_sample(
    run, marker, data_cache, capsys
):
    folder = sharded(run)
    plant(folder / files.SHARDED_META, marker)
    assert_refused(resume(run, data_cache), marker, "meta.pt")
    with pytest.raises(SystemExit) as stopped:
        lm(["sample", str(run), "def", "--max-new-tokens", "4"])
    assert stopped.value.code == EXIT_CONFIG and "meta.pt" in capsys.readouterr().err
    assert not marker.exists()


def test_a_payload_in_a_sharded_folders_index_or_inside_a_shard_is_refused(run, marker):
    """torch.distributed.checkpoint's own readers unpickle the index and the non-tensor items in full (an FSDP2
    resume reads them through Lightning): lm reads both as data first."""
    import pickle

    folder = sharded(run)
    index_file = folder / files.SHARD_INDEX
    good = index_file.read_bytes()
    index = files.read_index(folder)
    index.planted = Payload(marker)  # rides along in the pickled index
    index_file.write_bytes(pickle.dumps(index))
    with pytest.raises(UnsafeCheckpoint, match=r"posix\.system.*\.metadata|\.metadata.*posix\.system"):
        files.loadable(folder)
    index_file.write_bytes(good)

    # A non-tensor item (an optimizer group's `lr`, say) replaced by a payload appended to its shard, the
    # index pointing at it, as a planted folder's would.
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    fqn = next(k for k, v in index.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    info = index.storage_data[MetadataIndex(fqn)]
    evil = io.BytesIO()
    torch.save(Payload(marker), evil)
    shard = folder / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(evil.getvalue())
    with open(shard, "ab") as f:
        f.write(evil.getvalue())
    index_file.write_bytes(pickle.dumps(index))
    with pytest.raises(UnsafeCheckpoint, match=r"posix\.system"):
        files.read(folder)
    assert not marker.exists()


def test_a_payload_in_a_file_bucket_is_refused_on_a_new_machine(root, data_cache, marker, tmp_path):
    bucket = tmp_path / "bucket"
    remote = f"checkpoint.remote=file://{bucket}"
    main(config(root, data_cache, "mirrored", remote))
    prefix = bucket / "mirrored" / "checkpoints"
    pointer = json.loads((prefix / POINTER).read_text())
    newest = pointer["checkpoints"][0]
    obj = prefix / newest["file"]
    plant(obj, marker)
    data = obj.read_bytes()
    newest.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())  # the pointer made to match
    (prefix / POINTER).write_text(json.dumps(pointer))
    shutil.rmtree(root / "mirrored")  # a new machine: nothing local, the bucket is all there is
    error = None
    try:
        main(config(root, data_cache, "mirrored", remote, "trainer.max_steps=9"))
    except BaseException as e:
        error = e
    assert_refused(error, marker, f"step-{newest['step']}.ckpt")


def test_an_old_checkpoint_with_more_than_plain_types_resumes_through_the_opt_in(
    run, data_cache, monkeypatch
):
    """A checkpoint whose pickle holds numpy scalars (a callback of one's own kept them, or an older lm): refused
    by name, then read once through LM_TRUST_CHECKPOINT; the run trains on and its next save is plain data."""
    path = run / "checkpoints" / "step-6.ckpt"
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    ckpt["callbacks"]["OldCallback"] = {"best": np.float64(3.5), "seen": np.arange(3)}
    path.unlink()
    torch.save(ckpt, path)
    error = resume(run, data_cache)
    assert isinstance(error, UnsafeCheckpoint) and "numpy" in str(error)
    monkeypatch.setenv(TRUST_ENV, str(run / "checkpoints" / "last.ckpt"))
    assert resume(run, data_cache) is None
    monkeypatch.delenv(TRUST_ENV)
    resumed = files.read(run / "checkpoints" / "last.ckpt")  # weights_only: plain data again
    assert resumed["global_step"] == 9 and "OldCallback" not in resumed["callbacks"]


def test_the_opt_in_trusts_the_file_it_named_not_what_the_link_points_to_later(run, marker, monkeypatch):
    """LM_TRUST_CHECKPOINT=.../last.ckpt pins the step file the link resolved to, and its content, when first
    read: a payload the link points to later (a later save, a bucket's file) or written over the pinned file is
    read as data and refused, and never runs."""
    ckpts = run / "checkpoints"
    monkeypatch.setenv(TRUST_ENV, str(ckpts / "last.ckpt"))
    pinned = ckpts / "step-6.ckpt"
    state = torch.load(pinned, map_location="cpu", weights_only=True)
    state["callbacks"]["OldCallback"] = {"best": np.float64(3.5)}  # needs the opt-in to be read
    pinned.unlink()
    torch.save(state, pinned)
    assert files.read(ckpts / "last.ckpt")["callbacks"]["OldCallback"]["best"] == 3.5  # the opt-in, pinned
    later = ckpts / "step-9.ckpt"  # a later save the link moves to, planted
    shutil.copyfile(ckpts / "step-3.ckpt", later)
    plant(later, marker)
    (ckpts / "last.ckpt").unlink()
    (ckpts / "last.ckpt").symlink_to(later.name)
    with pytest.raises(UnsafeCheckpoint) as refused:
        files.read(ckpts / "last.ckpt")
    assert_refused(refused.value, marker, "step-9.ckpt")
    (ckpts / "last.ckpt").unlink()
    (ckpts / "last.ckpt").symlink_to(pinned.name)
    shutil.copyfile(later, pinned)  # the pinned file itself rewritten with a payload: not the content named
    with pytest.raises(UnsafeCheckpoint) as refused:
        files.read(ckpts / "last.ckpt")
    assert_refused(refused.value, marker, "step-6.ckpt")


def test_a_save_does_not_log_lightnings_weights_only_default(run, data_cache, caplog):
    """Lightning logs "`weights_only` was not set, defaulting to `False`" at a save that leaves it unset: about
    what is saved, it reads like an unsafe load to a user checking that checkpoints load as data. lm says what
    it saves (the full state), so the line never appears."""
    caplog.set_level("INFO", logger="lightning.pytorch.trainer.connectors.checkpoint_connector")
    assert resume(run, data_cache) is None  # saves at step 9
    assert files.read(run / "checkpoints" / "last.ckpt")["global_step"] == 9
    assert not [r for r in caplog.records if "weights_only" in r.getMessage()], caplog.text
