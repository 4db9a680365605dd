"""lm.checkpoint.files: the names every writer and reader of checkpoints shares, and the one loader."""

import os
from pathlib import Path

import torch

from lm.checkpoint import files


def test_names_round_trip_to_their_step():
    assert files.step_name(12) == "step-12.ckpt"
    assert files.checkpoint_step(Path("runs/x/checkpoints") / files.step_name(12)) == 12
    for other in (files.LAST, "step-12.ckpt.tmp-77", "step-x.ckpt", "step-12.ab12cd34.ckpt", "step-12.pt"):
        assert files.checkpoint_step(Path(other)) is None, other
    uploaded = files.remote_name(12)
    assert (
        uploaded.startswith("step-12.") and uploaded.endswith(".ckpt") and uploaded != files.remote_name(12)
    )
    assert files.is_step_object(uploaded) and files.is_step_object("step-12.ckpt")
    assert not files.is_step_object("latest.json") and not files.is_step_object("archive-1.json")


def test_step_files_are_newest_first_by_step_number_not_by_name(tmp_path):
    for name in ("step-9.ckpt", "step-10.ckpt", "step-100.ckpt", "step-99.ckpt", "notes.txt", "step-x.ckpt"):
        (tmp_path / name).touch()
    os.symlink("step-100.ckpt", tmp_path / files.LAST)
    assert [p.name for p in files.step_files(tmp_path)] == [files.step_name(s) for s in (100, 99, 10, 9)]
    assert files.step_files(tmp_path / "absent") == []


def test_read_loads_on_cpu_and_loadable_says_why_not(tmp_path):
    whole = tmp_path / files.step_name(3)
    torch.save(
        {"state_dict": {"w": torch.ones(2)}, "optimizer_states": [], "global_step": 3, "loops": {}}, whole
    )
    ckpt = files.read(whole)
    assert ckpt["global_step"] == 3 and ckpt["state_dict"]["w"].device.type == "cpu"
    assert files.loadable(whole) is None
    partial = tmp_path / files.step_name(2)
    torch.save({"state_dict": {}, "global_step": 2}, partial)
    assert files.loadable(partial) == "missing ['loops', 'optimizer_states']"
    truncated = tmp_path / files.step_name(1)
    truncated.write_bytes(whole.read_bytes()[:-100])
    assert files.loadable(truncated) is not None
