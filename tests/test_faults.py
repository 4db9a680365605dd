"""The fault matrix: every fault against a real `python train.py` process (tiny model, 2 DataLoader workers),
checked for its documented exit code, an exit within a bound (a hang fails with every process's stacks), a
rerun of the same command that resumes, final weights bitwise equal to an uninterrupted run's, and no good
checkpoint deleted.

The fast cases run in CI; the rest are marked `faults_slow`:
    python -m pytest -q -p no:cacheprovider -m faults_slow tests/test_faults.py      # only the slow ones
    python tests/run_matrix.py                                                      # all, and the table
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from lm.store.exits import EXIT_CONFIG, EXIT_PREEMPTED, EXIT_SAVE_FAILED

from .conftest import train_in_process
from .faults import fill
from .harness import (
    STEPS,
    Record,
    S3Server,
    Trigger,
    assert_kept,
    assert_matches_reference,
    checkpoints,
    fault,
    flip_bytes,
    last,
    marker,
    overrides,
    run,
    tree_digest,
)

BUCKET = "lm-faults"
CRASH = 1


@dataclass(frozen=True)
class Case:
    """One fault at one step: what the fault run must exit with, and what its rerun must do."""

    name: str
    action: str
    step: int = 9
    code: int = EXIT_PREEMPTED
    saved_at: int | None = None
    """The step last.ckpt holds after the fault run (None: not checked)."""
    resumes: bool = True
    """A rerun of the same command finishes (0) bitwise equal to the uninterrupted run."""
    exit_within_s: float = 60.0
    """Seconds from the fault to the exit: the step in flight, a save and the teardown on a loaded machine."""
    fast: bool = False
    """Runs in CI; otherwise marked faults_slow."""

    def param(self):
        return pytest.param(self, id=self.name, marks=[] if self.fast else [pytest.mark.faults_slow])


# A signal before step 9's forward saves step 10; in validation after step 16, step 17; while step 12's
# checkpoint is being written, step 13. SIGINT (Ctrl-C) is a stop signal like SIGTERM: save, exit 75.
SIGNALS = [
    Case(f"{sig}_{where}", sig if where == "step" else f"{sig}_in_{where}", saved_at=saved_at, fast=fast)
    for sig in ("sigterm", "sigusr1", "sigint")
    for where, saved_at in (("step", 10), ("val", 17), ("save", 13))
    for fast in [sig == "sigint" and where == "step"]
]
CASES = [
    *SIGNALS,
    # A shutdown signals the whole group: the DataLoader workers must survive until the save is done.
    Case("sigterm_group", "sigterm_group", saved_at=10),
    # A bug in any callback: a crash (1) that exits within seconds, never a hang with workers alive.
    Case("callback_raises", "raise", code=CRASH, saved_at=6, exit_within_s=30.0, fast=True),
    Case("callback_raises_in_val", "raise_in_val", code=CRASH, saved_at=12, exit_within_s=30.0),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def reference(root, data_cache) -> dict:
    """The uninterrupted run every case must reproduce (in this process: one start-up less)."""
    assert train_in_process(overrides(root, data_cache, "reference")) == 0
    return last(root, "reference")


@pytest.fixture
def row(request):
    """This case's row of the matrix table, written when the test ends (whatever the outcome)."""
    node = request.node
    record = Record(node.callspec.id if hasattr(node, "callspec") else node.name, test=node.nodeid)
    yield record
    record.write()


def copy_run(root: Path, source: str, name: str) -> Path:
    """A copy of a finished run (symlinks kept as links) to damage."""
    shutil.copytree(root / source, root / name, symlinks=True)
    return root / name


def rerun_resumes(args: list[str], root: Path, name: str, reference: dict, row: Record, **kw) -> None:
    """The same command again: exits 0, resumed from a checkpoint, bitwise equal; no good checkpoint lost."""
    ckpt_dir = root / name / "checkpoints"
    before = checkpoints(ckpt_dir)
    again = run(args, **kw)
    row.resumed = again.code == 0 and "resuming from" in again.stdout + again.stderr
    assert again.code == 0, again.tail()
    assert row.resumed, "the rerun did not resume from a checkpoint"
    assert_kept(before, ckpt_dir)
    assert_matches_reference(root, name, reference)
    row.equal = True


# -- signals and exceptions at a step, in validation, in a checkpoint write ------------------------------


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_fault_exits_with_its_code_and_a_rerun_resumes_exactly(root, data_cache, reference, row, case):
    name = case.name
    (root / name).mkdir(parents=True)
    args = overrides(root, data_cache, name, *fault(root / name, case.action, step=case.step))
    first = run(args)
    row.outcome(first, marker(root / name, case.action, case.step), case.code)
    assert first.code == case.code, first.tail()
    assert row.exit_s <= case.exit_within_s, f"{row.exit_s:.1f} s from the fault to the exit"
    assert "exited unexpectedly" not in first.stderr, first.tail()  # a DataLoader worker died under it
    if case.saved_at is not None:
        assert last(root, name)["global_step"] == case.saved_at
    if case.resumes:
        rerun_resumes(args, root, name, reference, row)


# -- a signal while a checkpoint is uploaded -----------------------------------------------------------


@pytest.fixture(scope="module")
def s3():
    """An S3-compatible server (moto) on loopback that a test may stop and start again."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = S3Server()
    server.fs().mkdir(BUCKET)
    yield server
    server.stop()


def pointer_steps(s3: S3Server, name: str) -> list[int]:
    """Steps listed by the run's latest.json in the bucket, newest first."""
    fs = s3.fs()
    try:
        doc = json.loads(fs.cat_file(f"{BUCKET}/runs/{name}/checkpoints/latest.json"))
    except FileNotFoundError:
        return []
    return sorted((e["step"] for e in doc["checkpoints"]), reverse=True)


@pytest.mark.faults_slow
@pytest.mark.parametrize("sig", ["sigterm", "sigusr1", "sigint"])
def test_signal_during_an_upload_saves_uploads_and_resumes(root, data_cache, reference, s3, row, sig):
    name = f"{sig}_upload"
    row.case = name
    (root / name).mkdir(parents=True)
    action = f"{sig}_in_upload"
    args = overrides(
        root, data_cache, name, f"checkpoint.remote=s3://{BUCKET}/runs", *fault(root / name, action, step=9)
    )
    first = run(args, env=s3.env)
    row.outcome(first, marker(root / name, action, 9), EXIT_PREEMPTED)
    assert first.code == EXIT_PREEMPTED, first.tail()
    assert row.exit_s <= 60
    saved = last(root, name)["global_step"]
    assert pointer_steps(s3, name)[:1] == [saved]  # the signal's checkpoint is in the bucket before exit
    rerun_resumes(args, root, name, reference, row, env=s3.env)
    assert pointer_steps(s3, name)[:1] == [STEPS]


# -- kills ---------------------------------------------------------------------------------------------


@pytest.mark.faults_slow
def test_supervised_run_survives_sigkill_at_five_random_points(root, data_cache, reference, row):
    name = row.case = "sigkill_5_random"
    (root / name).mkdir(parents=True)
    # Each kill at a seeded random moment up to 8 s after its process set up (a step, validation, a
    # checkpoint write, data loading), one per process until all five have fired.
    kills = [a for k in range(5) for a in fault(root / name, "sigkill_random", k, f"k{k}", seconds=8.0)]
    result = run(overrides(root, data_cache, name, *kills), supervised=True, timeout=600)
    row.outcome(result)
    assert result.code == 0, result.tail()
    assert result.stderr.count("signal SIGKILL") == 5, result.tail()
    row.resumed = True
    assert_kept({}, root / name / "checkpoints")
    assert_matches_reference(root, name, reference)
    row.equal = True


# -- the disk -------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs: room for the run's two checkpoints and logs, not for much more."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root or CAP_SYS_ADMIN")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.faults_slow
def test_full_disk_at_a_checkpoint_write_exits_74_then_resumes_once_freed(
    small_disk, data_cache, reference, row
):
    name = row.case = "disk_full_tmpfs"
    (small_disk / name).mkdir()
    args = overrides(small_disk, data_cache, name, *fault(small_disk / name, "fill_disk_in_save", step=9))
    first = run(args)
    fired = marker(small_disk / name, "fill_disk_in_save", 9)
    row.outcome(first, fired, EXIT_SAVE_FAILED)
    assert first.code == EXIT_SAVE_FAILED, first.tail()
    assert row.exit_s <= 60
    ckpt_dir = small_disk / name / "checkpoints"
    assert sorted(checkpoints(ckpt_dir)) == [6]  # the previous checkpoint is intact and loads
    assert not list(ckpt_dir.glob("*.tmp-*"))
    assert last(small_disk, name)["global_step"] == 6
    fired.with_name(fired.name + ".filler").unlink()  # space freed
    rerun_resumes(args, small_disk, name, reference, row)


@pytest.mark.faults_slow
def test_disk_filled_between_saves_exits_74_then_resumes_once_freed(small_disk, data_cache, reference, row):
    """Another process fills the disk mid-run: the next write anywhere in the run directory (TensorBoard, the
    cost ledger, the checkpoint) meets ENOSPC, and the run stops with 74, its checkpoints intact."""
    name = row.case = "disk_filled_mid_run"
    (small_disk / name).mkdir()
    args = overrides(small_disk, data_cache, name, *fault(small_disk / name, "pause", step=8))
    fired = marker(small_disk / name, "pause", 8)
    filler = small_disk / "filler"
    first = run(args, triggers=(Trigger.at_pause(fired, lambda: fill(filler)),))
    row.outcome(first, fired, EXIT_SAVE_FAILED)
    assert first.code == EXIT_SAVE_FAILED, first.tail()
    assert row.exit_s <= 60
    ckpt_dir = small_disk / name / "checkpoints"
    assert sorted(checkpoints(ckpt_dir)) == [6]
    filler.unlink()
    rerun_resumes(args, small_disk, name, reference, row)


@pytest.mark.faults_slow
def test_checkpoint_dir_removed_under_a_running_process_is_recreated(root, data_cache, reference, row):
    """Decided: the next save recreates the folder and the run finishes (0) with every checkpoint it would
    have had; the process still holds the whole state, so stopping would only throw it away. Never a hang,
    never a 0 without a checkpoint."""
    name = row.case = "checkpoint_dir_removed"
    (root / name).mkdir(parents=True)
    ckpt_dir = root / name / "checkpoints"
    args = overrides(root, data_cache, name, *fault(root / name, "pause", step=9))
    fired = marker(root / name, "pause", 9)
    result = run(args, triggers=(Trigger.at_pause(fired, lambda: shutil.rmtree(ckpt_dir)),))
    row.outcome(result, fired)
    assert not (ckpt_dir / "step-6.ckpt").exists()  # it was removed while the run went on
    assert result.code == 0, result.tail()
    assert sorted(checkpoints(ckpt_dir)) == [18, 20]
    assert_matches_reference(root, name, reference)
    row.equal = True


# -- object storage down ----------------------------------------------------------------------------------


@pytest.mark.faults_slow
def test_s3_stopped_mid_run_and_restarted_finishes_with_the_latest_in_the_bucket(
    root, data_cache, reference, s3, row
):
    name = row.case = "s3_down_mid_run"
    (root / name).mkdir(parents=True)
    args = overrides(
        root,
        data_cache,
        name,
        f"checkpoint.remote=s3://{BUCKET}/runs",
        *fault(root / name, "pause", step=8, key="down"),  # after step 6's upload
        *fault(root / name, "pause", step=14, key="up"),  # step 12's upload met a dead server
    )
    triggers = (
        Trigger.at_pause(marker(root / name, "pause", 8, "down"), s3.stop),
        Trigger.at_pause(marker(root / name, "pause", 14, "up"), s3.start),
    )
    try:
        result = run(args, env=s3.env, triggers=triggers)
    finally:
        s3.start()
    row.outcome(result)
    assert result.code == 0, result.tail()
    assert pointer_steps(s3, name)[:1] == [STEPS]
    assert_matches_reference(root, name, reference)
    row.equal = True


@pytest.mark.faults_slow
def test_s3_down_at_start_for_less_than_the_retry_window_is_waited_for(root, data_cache, reference, s3, row):
    name = row.case = "s3_down_at_start"
    (root / name).mkdir(parents=True)
    args = overrides(root, data_cache, name, f"checkpoint.remote=s3://{BUCKET}/runs")
    s3.stop()
    try:  # down from before the start until 3 s after the doctor's table, which comes just before the probe
        result = run(args, env=s3.env, triggers=(Trigger.after_output("doctor:", 3.0, s3.start),))
    finally:
        s3.start()
    row.outcome(result)
    assert result.code == 0, result.tail()
    assert pointer_steps(s3, name)[:1] == [STEPS]
    assert_matches_reference(root, name, reference)
    row.equal = True


# -- damaged checkpoints --------------------------------------------------------------------------------


def truncate_newest(ckpt_dir: Path) -> None:
    newest = (ckpt_dir / "last.ckpt").resolve()
    with open(newest, "r+b") as f:  # what a kill mid-write leaves without an atomic rename
        f.truncate(newest.stat().st_size // 2)


def remove_newest(ckpt_dir: Path) -> None:
    (ckpt_dir / "last.ckpt").resolve().unlink()  # last.ckpt now points at a missing file


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(truncate_newest, id="truncated_checkpoint"),
        pytest.param(remove_newest, id="last_dangling", marks=pytest.mark.faults_slow),
    ],
)
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(root, data_cache, reference, row, damage):
    """The reference run's step-20 (what last.ckpt points at) is damaged: the rerun resumes from step 18 and
    ends at step 20 again, bitwise equal."""
    name = row.case
    ckpt_dir = copy_run(root, "reference", name) / "checkpoints"
    before = checkpoints(ckpt_dir)
    damage(ckpt_dir)
    result = run(overrides(root, data_cache, name))
    row.outcome(result)
    assert result.code == 0, result.tail()
    row.resumed = "resuming from" in result.stdout + result.stderr
    assert row.resumed, result.tail()
    assert sorted(checkpoints(ckpt_dir)) == [18, 20]
    assert checkpoints(ckpt_dir)[18] == before[18]  # the good one it fell back to is untouched
    assert_matches_reference(root, name, reference)
    row.equal = True


# -- a damaged run tokenizer (the file export and sampling read) -------------------------------------------


def test_damaged_run_tokenizer_is_restored_from_the_prepared_data_and_the_run_resumes(
    root, data_cache, reference, row
):
    name = row.case
    run_dir = copy_run(root, "reference", name)
    kept = (run_dir / "tokenizer.json").read_bytes()
    flip_bytes(run_dir / "tokenizer.json")
    result = run(overrides(root, data_cache, name))
    row.outcome(result)
    assert result.code == 0, result.tail()
    row.resumed = "resuming from" in result.stdout + result.stderr
    assert row.resumed, result.tail()
    assert "repaired it from the prepared data's" in result.stdout + result.stderr, result.tail()
    assert (run_dir / "tokenizer.json").read_bytes() == kept
    assert_matches_reference(root, name, reference)
    row.equal = True


def test_damaged_run_and_data_tokenizers_are_refused_with_78_naming_both(root, data_cache, reference, row):
    name = row.case
    run_dir = copy_run(root, "reference", name)
    folder = root / f"tokens-{name}"
    shutil.copytree(next(p for p in data_cache.iterdir() if (p / "manifest.json").exists()), folder)
    flip_bytes(run_dir / "tokenizer.json")
    flip_bytes(folder / "tokenizer.json")
    before = tree_digest(run_dir)
    result = run(overrides(root, data_cache, name, "data=tokens", f"data.dir={folder}"), timeout=120)
    row.outcome(result, expected=EXIT_CONFIG)
    assert result.code == EXIT_CONFIG, result.tail()
    assert str(run_dir / "tokenizer.json") in result.stderr, result.tail()
    assert str(folder / "tokenizer.json") in result.stderr, result.tail()
    assert tree_digest(run_dir) == before


# -- refusals: before anything is written ----------------------------------------------------------------

REFUSALS = [
    # Values Lightning would only reject deep inside fit (or run with nonsense): the config refuses them.
    pytest.param(["trainer.val_every_steps=0"], "val_every_steps", id="val_every_steps_0"),
    pytest.param(["trainer.max_steps=0"], "max_steps", id="max_steps_0", marks=pytest.mark.faults_slow),
    pytest.param(["data.batch_size=0"], "batch_size", id="batch_size_0", marks=pytest.mark.faults_slow),
    pytest.param(["data.seq_len=128", "model.max_seq_len=64"], "max_seq_len", id="seq_len_over_max_seq_len"),
]


@pytest.mark.parametrize(("bad", "names"), REFUSALS)
def test_bad_config_is_refused_with_78_and_the_run_directory_unchanged(
    root, data_cache, reference, row, bad, names
):
    name = row.case
    run_dir = copy_run(root, "reference", name)  # an existing run that a bad invocation must not touch
    before = tree_digest(run_dir)
    result = run([*overrides(root, data_cache, name), *bad], timeout=120)
    row.outcome(result, expected=EXIT_CONFIG)
    assert result.code == EXIT_CONFIG, result.tail()
    assert names in result.stderr, result.tail()  # the message names the key to fix
    assert tree_digest(run_dir) == before


def test_a_changed_data_stream_key_on_resume_is_refused_with_78_naming_it(root, data_cache, reference, row):
    """Windows cut at another length would put the resumed position on other tokens: refused under the lock,
    before anything but the lock's holder changes."""
    name = row.case
    run_dir = copy_run(root, "reference", name)
    before = tree_digest(run_dir)
    result = run([*overrides(root, data_cache, name), "data.seq_len=32"], timeout=120)
    row.outcome(result, expected=EXIT_CONFIG)
    assert result.code == EXIT_CONFIG, result.tail()
    assert "data.seq_len=64 -> 32" in result.stderr and "model.init_from" in result.stderr, result.tail()
    after = tree_digest(run_dir)
    assert {k: v for k, v in after.items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"
    }


def truncate_shard(folder: Path) -> str:
    shard = sorted(folder.glob("train-*.bin"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    return shard.name


def wrong_sha(folder: Path) -> str:
    manifest = json.loads((folder / "manifest.json").read_text())
    shard = manifest["splits"]["train"]["shards"][0]
    shard["sha256"] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return Path(shard["file"]).name


@pytest.mark.parametrize(
    "damage", [pytest.param(truncate_shard, id="truncated_shard"), pytest.param(wrong_sha, id="manifest_sha")]
)
def test_damaged_token_data_is_refused_with_78_naming_the_shard(root, data_cache, reference, row, damage):
    name = row.case
    folder = root / f"tokens-{name}"
    shutil.copytree(next(p for p in data_cache.iterdir() if (p / "manifest.json").exists()), folder)
    shard = damage(folder)
    result = run(overrides(root, data_cache, name, "data=tokens", f"data.dir={folder}"), timeout=120)
    row.outcome(result, expected=EXIT_CONFIG)
    assert result.code == EXIT_CONFIG, result.tail()
    assert shard in result.stderr, result.tail()
    assert not list((root / name).glob("checkpoints/*.ckpt"))
