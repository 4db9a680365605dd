"""checkpoint.format=sharded: a folder of torch.distributed.checkpoint shards per step, visible only when complete.

In one process (DCP saves without a process group): the layout, the corruption check, rotation, the remains of
an interrupted write, a failed write. Under torchrun (slow): FSDP2 ranks write their shards, and the folder
resumes on 1, 2 and 4 processes to the weights of one process trained straight, and is read by `lm sample`'s
loader.
"""

import errno
import shutil
import sys
from pathlib import Path

import pytest
import torch

from lm.base.exits import CheckpointSaveError, Refused
from lm.checkpoint import files
from lm.checkpoint.checkpointer import find_resume_point, remove_all_temporaries
from lm.checkpoint.formats import SHARDED, ShardedFolder
from lm.checkpoint.local import AtomicCheckpointIO, rotate
from lm.config import to_objects
from lm.interop.hf import load_run

from ..conftest import TINY
from ..engine.test_distributed import B, W, launch, overrides, torchrun


def training_state(step: int) -> dict:
    """What Lightning hands a checkpoint IO: weights, an optimizer state keyed by name (as torch's distributed
    state dicts are), and plain Python state."""
    torch.manual_seed(step)
    w, g = torch.randn(8, 4), torch.randn(4)
    return {
        "state_dict": {"model.w": w, "model.g": g},
        "optimizer_states": [
            {
                "state": {"model.w": {"exp_avg": w * 2, "step": torch.tensor(float(step))}, "model.g": {}},
                "param_groups": [{"params": ["model.w"], "lr": 1e-3}, {"params": ["model.g"], "lr": 2e-3}],
            }
        ],
        "global_step": step,
        "loops": {"fit_loop": {"step": step}},
        "hyper_parameters": {"optim": {"name": "adamw"}},
    }


def save(ckpt_dir: Path, step: int) -> Path:
    path = ckpt_dir / files.step_name(step)
    AtomicCheckpointIO(fmt=SHARDED).save_checkpoint(training_state(step), path)
    return path


def test_a_sharded_checkpoint_is_a_folder_that_reads_back_as_the_full_state(tmp_path):
    path = save(tmp_path, 5)
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert files.is_sharded(path) and SHARDED.exists(path) and files.loadable(path) is None
    assert [p.name for p in files.step_files(tmp_path)] == ["step-5.ckpt"]
    ckpt = files.read(path)
    want = training_state(5)
    assert ckpt["global_step"] == 5 and ckpt["loops"] == want["loops"]
    assert all(torch.equal(ckpt["state_dict"][k], v) for k, v in want["state_dict"].items())
    optim = ckpt["optimizer_states"][0]  # keyed by index in group order, as Optimizer.load_state_dict maps
    assert [g["params"] for g in optim["param_groups"]] == [[0], [1]]
    assert [g["lr"] for g in optim["param_groups"]] == [1e-3, 2e-3]
    assert torch.equal(optim["state"][0]["exp_avg"], want["state_dict"]["model.w"] * 2)
    assert files.read_meta(path)["hyper_parameters"] == want["hyper_parameters"]
    assert "state_dict" not in files.read_meta(path)  # the resume check never reads the tensors


@pytest.mark.parametrize("damage", ["truncate", "drop_shard", "drop_index", "drop_meta"])
def test_a_damaged_folder_is_set_aside_and_the_previous_checkpoint_resumed(tmp_path, damage):
    ckpt_dir = tmp_path / "checkpoints"
    older, newer = save(ckpt_dir, 3), save(ckpt_dir, 6)
    (ckpt_dir / files.LAST).symlink_to(newer.name)
    shard = newer / "__0_0.distcp"
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    else:
        name = {"drop_shard": shard.name, "drop_index": files.SHARD_INDEX, "drop_meta": files.SHARDED_META}
        (newer / name[damage]).unlink()
    why = files.loadable(newer)
    assert why is not None and (damage != "truncate" or "truncated" in why), why
    assert find_resume_point(tmp_path) == ckpt_dir / files.LAST
    assert (ckpt_dir / files.LAST).resolve() == older.resolve()
    assert [p.name.split(".ckpt")[0] for p in (ckpt_dir / "corrupt").iterdir()] == ["step-6"]


def test_rotation_and_the_remains_of_an_interrupted_write_remove_folders(tmp_path):
    for step in (2, 4, 6):
        save(tmp_path, step)
    (tmp_path / files.LAST).symlink_to("step-6.ckpt")
    assert [p.name for p in rotate(tmp_path, 2, 6)] == ["step-2.ckpt"]
    assert not (tmp_path / "step-2.ckpt").exists() and (tmp_path / "step-4.ckpt").is_dir()
    half = tmp_path / f"step-8.ckpt{ShardedFolder.SUFFIX}"  # a kill before the rename: never a step-8.ckpt
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"\0" * 10)
    assert files.step_files(tmp_path) == [tmp_path / "step-6.ckpt", tmp_path / "step-4.ckpt"]
    remove_all_temporaries(tmp_path)
    assert not half.exists()


def test_a_failed_sharded_write_leaves_the_previous_checkpoints_and_no_folder(tmp_path, monkeypatch):
    save(tmp_path, 3)
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    with pytest.raises(CheckpointSaveError, match="disk is full.*previous checkpoints are intact"):
        save(tmp_path, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3.ckpt"]
    assert files.loadable(tmp_path / "step-3.ckpt") is None


def test_sharded_checkpoints_need_fsdp(compose):
    to_objects(compose(*TINY, "trainer=fsdp", "checkpoint.format=sharded"))
    with pytest.raises(Refused, match="checkpoint.format=sharded.*trainer.strategy=auto.*trainer=fsdp"):
        to_objects(compose(*TINY, "checkpoint.format=sharded"))
    to_objects(compose(*TINY, "trainer=fsdp", "checkpoint.format=sharded", "checkpoint.remote=s3://b/r"))
    with pytest.raises(Refused, match="checkpoint.format='zip' is unknown; use one of full, sharded"):
        to_objects(compose(*TINY, "checkpoint.format=zip"))
    with pytest.raises(Refused, match="async_save=true.*checkpoint.format=sharded"):
        to_objects(compose(*TINY, "checkpoint.async_save=true"))


def weights(run: Path) -> dict[str, torch.Tensor]:
    return files.read(run / "checkpoints" / files.LAST)["state_dict"]


def assert_close(a: dict, b: dict, atol: float = 2e-4) -> None:
    """test_distributed's tolerance for W ranks against one process (measured here: 1.3e-7)."""
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, worst


@pytest.mark.slow
def test_fsdp_shards_resume_on_1_2_and_4_processes_like_one_process_trained_straight(root, data_cache):
    """2 FSDP2 ranks write 6 steps of shards; the folder continues to step 9 on one process (full files from
    then on), on 2 ranks and on 4 ranks (resharded by DCP), each equal to one process trained 9 steps."""
    sharded = ["trainer=fsdp", "trainer.accelerator=cpu", "checkpoint.format=sharded"]
    launch([*torchrun(W), *overrides(root, data_cache, "shards", *sharded, f"trainer.devices={W}", f"data.batch_size={B}", "trainer.max_steps=6")])  # fmt: skip
    run = root / "shards"
    step6 = run / "checkpoints" / "step-6.ckpt"
    assert files.is_sharded(step6) and files.loadable(step6) is None
    assert sorted(p.name for p in step6.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one per rank
    assert (run / "checkpoints" / files.LAST).resolve() == step6.resolve()
    loaded = load_run(step6)  # what lm sample / export / eval open
    assert loaded.step == 6 and load_run(run).step == 6

    launch([sys.executable, "train.py", *overrides(root, data_cache, "single", "trainer=cpu", f"data.batch_size={W * B}", "trainer.max_steps=9")])  # fmt: skip
    for name, world in (("one", 1), ("two", 2), ("four", 4)):
        shutil.copytree(run, root / name, symlinks=True)
        if world == 1:
            args = ["trainer=cpu", f"data.batch_size={W * B}"]
            cmd = [sys.executable, "train.py"]
        else:
            args = [*sharded, f"trainer.devices={world}", f"data.batch_size={W * B // world}"]
            cmd = torchrun(world)
        launch([*cmd, *overrides(root, data_cache, name, *args, "trainer.max_steps=9")])
        assert files.read_meta(root / name / "checkpoints" / files.LAST)["global_step"] == 9
        assert files.is_sharded(root / name / "checkpoints" / "step-9.ckpt") == (world > 1)
        assert_close(weights(root / name), weights(root / "single"))
