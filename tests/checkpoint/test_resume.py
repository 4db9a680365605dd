"""Resuming with a changed config (applied and logged, or refused by name) and rotation in a copied run."""

import hashlib
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lm.base.exits import EXIT_CONFIG, Refused, exit_code
from lm.callbacks.run_tokenizer import tokenizer_findings
from lm.checkpoint.local import rotate
from lm.config import DataConfig, OptimConfig
from lm.engine.module import lr_lambda
from lm.run.train import main
from lm.store import rundir

from ..conftest import CONF, TINY, train_in_process
from ..data.test_mixture import SEQ, VOCAB, corpora  # noqa: F401 (a fixture, prepared once a session)
from ..harness import flip_bytes

ROOT = CONF.parent
RUN = [
    "optim.total_steps=30",  # the schedule spans the plan; step 20 lies in the decay
    "optim.warmup_steps=2",
    "optim.decay_fraction=0.5",
    "checkpoint.every_n_steps=5",
    "trainer.val_every_steps=100",
    "trainer.limit_val_batches=1",
    "+trainer.extra.num_sanity_val_steps=0",
    "data.num_workers=0",
]


def ckpt(run: Path) -> dict:
    return torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)


def files(run: Path) -> dict[str, str]:
    """sha256 of every file of a run directory but the invocation logs (hydra/) and the lock (which names its
    latest holder: the refusal comes after the resume point is found, under the lock), by relative path."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and "hydra" not in p.relative_to(run).parts and p.name != ".lock"
    }


def test_a_changed_optimizer_setting_is_applied_from_the_resumed_step_and_logged(tiny_cfg, tmp_path, caplog):
    runs = tmp_path / "runs"
    main(tiny_cfg(*RUN, "run.name=same", "trainer.max_steps=10"))
    shutil.copytree(runs / "same", runs / "changed", symlinks=True)  # two runs at the same step-10 state
    main(tiny_cfg(*RUN, "run.name=same", "trainer.max_steps=20"))
    # fused: the guard against non-finite steps reads the config's kernel; the groups must run that kernel.
    changes = ["optim.lr=3e-3", "optim.weight_decay=0.05", "optim.betas=[0.9,0.99]", "optim.fused=true"]
    with caplog.at_level(logging.INFO):
        main(tiny_cfg(*RUN, "run.name=changed", "trainer.max_steps=20", *changes))

    same, changed = ckpt(runs / "same"), ckpt(runs / "changed")
    assert changed["global_step"] == 20
    assert any(not torch.equal(same["state_dict"][k], changed["state_dict"][k]) for k in same["state_dict"])
    # The LR the schedule gives at step 20 under the new config (not the old peak carried in the checkpoint).
    new = OptimConfig(lr=3e-3, warmup_steps=2, decay_fraction=0.5, total_steps=30)
    multiplier = lr_lambda(new, total_steps=30)(20)
    decay, no_decay = changed["optimizer_states"][0]["param_groups"]
    assert decay["lr"] == pytest.approx(3e-3 * multiplier) and no_decay["lr"] == decay["lr"]
    assert changed["lr_schedulers"][0]["base_lrs"] == [3e-3, 3e-3]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert tuple(decay["betas"]) == (0.9, 0.99) and decay["fused"] and no_decay["fused"]
    assert same["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(1e-3 * multiplier)
    assert changed["hyper_parameters"]["optim"]["lr"] == 3e-3  # recorded = trained with

    said = caplog.text
    assert "resumed at step 10" in said
    for line in (
        "optim.lr 0.001 -> 0.003",
        "optim.weight_decay 0.1 -> 0.05",
        "optim.betas [0.9, 0.95] -> [0.9, 0.99]",
    ):
        assert line in said
    text = EventAccumulator(str(runs / "changed/tb"), size_guidance={"tensors": 0}).Reload()
    [event] = text.Tensors("resume/changes/text_summary")
    assert event.step == 10 and b"optim.lr" in event.tensor_proto.string_val[0]


def test_another_architecture_is_refused_and_the_run_left_as_it_was(tiny_cfg, tmp_path, data_cache):
    main(tiny_cfg(*RUN, "trainer.max_steps=5"))
    run = tmp_path / "runs/smoke"
    before = files(run)
    cmd = [sys.executable, "train.py", *TINY, f"run.root={tmp_path / 'runs'}", f"data.cache_dir={data_cache}"]
    cmd += [*RUN, "trainer.max_steps=10", "model.n_layer=3"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    assert "model.n_layer=2 -> 3" in result.stderr and "run.resume=false" in result.stderr
    assert (
        files(run) == before
    )  # config.yaml, checkpoints, TensorBoard: as the last good invocation left them
    assert ckpt(run)["global_step"] == 5


@pytest.mark.slow
def test_a_copied_run_directory_rotates_the_checkpoints_it_brought(compose, tmp_path):
    first = tmp_path / "runs"
    main(compose(*TINY, *RUN, "trainer.max_steps=15", "checkpoint.keep_last=2"))
    ckpts = first / "smoke/checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*.ckpt")) == ["step-10.ckpt", "step-15.ckpt"]
    (ckpts / "notes.txt").write_text("a user's file")
    (ckpts / "step-abc.ckpt").write_text("not a step checkpoint")
    moved = tmp_path / "moved"
    subprocess.run(["cp", "-r", str(first), str(moved)], check=True, timeout=60)

    main(compose(*TINY, *RUN, f"run.root={moved}", "trainer.max_steps=25", "checkpoint.keep_last=2"))
    kept = moved / "smoke/checkpoints"
    assert sorted(p.name for p in kept.glob("step-*.ckpt")) == [
        "step-20.ckpt",
        "step-25.ckpt",
        "step-abc.ckpt",
    ]
    assert (kept / "notes.txt").read_text() == "a user's file"
    assert (kept / "last.ckpt").resolve().name == "step-25.ckpt"


def test_rotation_keeps_the_newest_past_steps_the_link_and_foreign_files(tmp_path):
    for step in range(1, 10):
        (tmp_path / f"step-{step}.ckpt").write_bytes(b"x")
    for name in ("notes.txt", "step-abc.ckpt", "step-3.ckpt.tmp-99"):
        (tmp_path / name).write_bytes(b"y")
    (tmp_path / "last.ckpt").symlink_to("step-2.ckpt")
    # Present: step 6 (a run resumed from step 2 left steps 7-9 behind, a future it will overwrite).
    deleted = rotate(tmp_path, keep_last=2, present=6)
    assert sorted(p.name for p in deleted) == ["step-1.ckpt", "step-3.ckpt", "step-4.ckpt"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [
        "last.ckpt", "notes.txt", "step-2.ckpt", "step-3.ckpt.tmp-99", "step-5.ckpt", "step-6.ckpt",
        "step-7.ckpt", "step-8.ckpt", "step-9.ckpt", "step-abc.ckpt",
    ]  # fmt: skip
    assert rotate(tmp_path, keep_last=-1, present=9) == []


# -- the run's tokenizer: checked against tokenizer_info.json at every start ------------------------------


def test_a_damaged_run_tokenizer_is_restored_from_the_data_or_refused_naming_both(tmp_path):
    prepared, run_dir = tmp_path / "prepared.json", tmp_path / "run"
    prepared.write_text('{"version": "1.0", "model": "a"}')
    rundir.keep_tokenizer(run_dir, prepared, "<|endoftext|>", 0, resumed=False)
    (run_dir / rundir.CHECKPOINTS).mkdir()
    (run_dir / rundir.CHECKPOINTS / "step-5.ckpt").write_bytes(b"x")  # a run that will resume
    data = DataConfig(source="tokens", dir=str(tmp_path))  # prepared_folder: data.dir itself
    (tmp_path / "tokenizer.json").write_bytes(prepared.read_bytes())
    flip_bytes(run_dir / rundir.TOKENIZER)

    [finding] = tokenizer_findings(run_dir, data, resume=True)  # preflight: says so, writes nothing
    assert finding.level == "ok" and "restored from" in finding.what
    assert tokenizer_findings(run_dir, data, resume=False) == []  # the run is archived, not resumed
    rundir.keep_tokenizer(run_dir, prepared, "<|endoftext|>", 0, resumed=True)  # at setup: restored
    assert (run_dir / rundir.TOKENIZER).read_bytes() == prepared.read_bytes()
    assert rundir.read_tokenizer(run_dir)["eot_id"] == 0  # what export checks

    flip_bytes(run_dir / rundir.TOKENIZER)
    flip_bytes(tmp_path / "tokenizer.json")
    [finding] = tokenizer_findings(run_dir, data, resume=True)
    assert finding.level == "error"
    assert (
        str(run_dir / rundir.TOKENIZER) in finding.what and str(tmp_path / "tokenizer.json") in finding.what
    )
    damaged = (run_dir / rundir.TOKENIZER).read_bytes()
    with pytest.raises(Refused, match="cannot restore it"):
        rundir.keep_tokenizer(run_dir, tmp_path / "tokenizer.json", "<|endoftext|>", 0, resumed=True)
    assert (run_dir / rundir.TOKENIZER).read_bytes() == damaged  # refused: left as it was


def test_a_resume_restores_a_damaged_run_tokenizer_and_says_so(tiny_cfg, tmp_path, caplog):
    main(tiny_cfg(*RUN, "trainer.max_steps=5"))
    run = tmp_path / "runs/smoke"
    kept = (run / "tokenizer.json").read_bytes()
    flip_bytes(run / "tokenizer.json")
    with caplog.at_level(logging.INFO):
        main(tiny_cfg(*RUN, "trainer.max_steps=10"))
    assert ckpt(run)["global_step"] == 10
    assert (run / "tokenizer.json").read_bytes() == kept
    assert "restored from" in caplog.text  # the doctor's line, before anything changed
    assert f"{run / 'tokenizer.json'} was not the tokenizer tokenizer_info.json records" in caplog.text
    assert "repaired it from the prepared data's" in caplog.text


# -- the data stream: changes applied and logged, or refused by name --------------------------------------


def mixture_run(sources: dict[str, Path], tmp_path: Path, web: float, code: float, steps: int) -> list[str]:
    mixture = f"{{name:web,dir:'{sources['web']}',weight:{web}}},{{name:code,dir:'{sources['code']}',weight:{code}}}"
    return [
        *TINY, f"run.root={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}", "data=mixture",
        f"data.mixture=[{mixture}]", f"data.vocab_size={VOCAB}", f"data.seq_len={SEQ}", "data.batch_size=4",
        "data.num_workers=0", "trainer.val_every_steps=100", "trainer.limit_val_batches=1",
        "checkpoint.every_n_steps=4", "+trainer.extra.num_sanity_val_steps=0", "sampling.prompts=[]",
        f"trainer.max_steps={steps}", "run.name=mix",
    ]  # fmt: skip


def test_changed_mixture_weights_on_resume_are_applied_logged_and_recorded(corpora, tmp_path, caplog):  # noqa: F811
    assert train_in_process(mixture_run(corpora, tmp_path, 0.7, 0.3, steps=4)) == 0
    with caplog.at_level(logging.INFO):
        assert train_in_process(mixture_run(corpora, tmp_path, 0.5, 0.5, steps=6)) == 0
    run = tmp_path / "runs/mix"
    assert ckpt(run)["global_step"] == 6
    said = caplog.text
    assert "resumed at step 4 with a changed setting, applied from here on" in said
    assert "data.mixture.web.weight 0.7 -> 0.5" in said and "data.mixture.code.weight 0.3 -> 0.5" in said
    assert "the data stream from step 4 on differs from an uninterrupted run's" in said
    [event] = (
        EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0})
        .Reload()
        .Tensors("resume/changes/text_summary")
    )
    table = event.tensor_proto.string_val[0].decode()
    assert event.step == 4 and "| data.mixture.web.weight | 0.7 | 0.5 |" in table
    assert "data.mixture (sources)" not in table  # what did not change is not listed


@pytest.mark.parametrize(
    ("override", "named"), [("data.seq_len=32", "data.seq_len=64 -> 32"), ("data.seed=1", "data.seed=0 -> 1")]
)
def test_a_changed_window_cut_or_order_on_resume_is_refused_by_name(tiny_cfg, tmp_path, override, named):
    main(tiny_cfg(*RUN, "trainer.max_steps=5"))
    run = tmp_path / "runs/smoke"
    before = files(run)
    with pytest.raises(Refused, match="was trained on another data stream") as refused:
        main(tiny_cfg(*RUN, "trainer.max_steps=10", override))
    assert named in str(refused.value) and "model.init_from" in str(refused.value)
    assert exit_code(refused.value) == EXIT_CONFIG
    assert files(run) == before
