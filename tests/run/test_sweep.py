"""Sweeps that report what they found, and the SkyPilot task ranked by $/token."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from lm.base.exits import EXIT_CONFIG
from lm.cli import main as lm
from lm.config import conf_dir, register_configs, to_objects
from lm.numbers.cost import flops_per_token, load_catalog, non_embedding_params
from lm.run.sweep import read_job, write_summary
from lm.run.train import main as train_main
from lm.store.rundir import read_scalars
from lm.tools.sky import ASSUMED_MFU, memory_needed_gb, rank_gpus, render_task

from ..conftest import CONF, TINY

ROOT = Path(__file__).resolve().parents[2]


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_multirun_summary_has_one_row_per_job_with_each_runs_numbers(tmp_path, data_cache):
    overrides = [*TINY, f"run.root={tmp_path}", f"data.cache_dir={data_cache}", "run.name=sw"]
    overrides += ["trainer.max_steps=4", "trainer.val_every_steps=2", "cost.price_per_hour=2.0"]
    cmd = [sys.executable, "train.py", "-m", "optim.lr=3e-3,1e-3,-1", *overrides]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    # The refused job (lr=-1) fails alone: the others still train, then the sweep exits with its code.
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    sweep = tmp_path / "sw"
    rows = read_rows(sweep / "sweep_summary.csv")
    assert sorted(r["job"] for r in rows) == ["optim.lr=-1", "optim.lr=0.001", "optim.lr=0.003"]

    done = [r for r in rows if r["status"] == "completed"]
    assert len(done) == 2 and [r["rank"] for r in done] == ["1", "2"]
    assert float(done[0]["val_loss"]) <= float(done[1]["val_loss"])
    assert [r["best"] for r in rows] == ["1", "0", "0"]
    for row in done:
        run = sweep / row["job"]
        ledger = json.loads((run / "cost.json").read_text())
        tb_loss = read_scalars(run)["val/loss"].values[-1]
        assert float(row["val_loss"]) == pytest.approx(tb_loss, rel=1e-6)
        assert json.loads((run / "job.json").read_text())["objective"] == pytest.approx(tb_loss, rel=1e-6)
        assert float(row["usd"]) == pytest.approx(ledger["usd"]) and ledger["usd"] > 0
        assert int(row["tokens"]) == ledger["tokens"] == 4 * 8 * 64
        assert row["stop"] == "max_steps (4)" and row["optim.lr"] == row["job"].split("=")[1]
        assert float(row["tokens_per_sec"]) == pytest.approx(ledger["tokens"] / ledger["seconds"]["train"])
        assert float(row["usd_per_billion_tokens"]) == pytest.approx(ledger["usd"] / ledger["tokens"] * 1e9)
    failed = rows[-1]
    assert failed["status"] == "failed" and failed["val_loss"] == ""
    assert "Refused: optim.lr must be positive" in failed["stop"] and "(exit 78)" in failed["stop"]
    md = (sweep / "sweep_summary.md").read_text()
    assert f"**Best: `optim.lr={done[0]['optim.lr']}`**" in md and "1 failed" in md

    # `lm sweep-summary` rebuilds the same table from disk (an interrupted sweep has no on_multirun_end).
    before = (sweep / "sweep_summary.csv").read_text()
    (sweep / "sweep_summary.csv").unlink()
    lm(["sweep-summary", str(sweep)])
    assert (sweep / "sweep_summary.csv").read_text() == before
    with pytest.raises(FileNotFoundError, match="single run's directory"):
        write_summary(sweep / "optim.lr=0.001")


def test_an_early_stopped_run_reads_back_with_its_reason_and_logged_loss(tiny_cfg, tmp_path):
    # No job.json (a run made outside a multirun): the loss comes from TensorBoard, the reason from stop.json.
    loss = train_main(
        tiny_cfg(
            "run.name=sw/target",
            "trainer.max_steps=6",
            "trainer.val_every_steps=2",
            "early_stopping.target_loss=100",
            "early_stopping.cooldown_fraction=0",
        )
    )
    row = read_job(tmp_path / "runs/sw/target")
    assert row.status == "completed" and row.val_loss == pytest.approx(loss, rel=1e-6)
    assert row.stop.startswith("early stop at step") and "(target_loss)" in row.stop and row.step < 6
    _, rows = write_summary(tmp_path / "runs/sw")
    assert [r.job for r in rows] == ["target"]


def compose_with_hydra(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("train", overrides=list(overrides), return_hydra_config=True)


def test_sweep_lr_is_eight_short_spot_runs_of_the_1b_plan(compose):
    hydra_cfg = compose_with_hydra("+experiment=sweep_lr")
    lrs = [float(v) for v in hydra_cfg.hydra.sweeper.params["optim.lr"].split(",")]
    assert len(lrs) == 8 and lrs == sorted(lrs) and min(lrs) < 3e-4 < max(lrs)
    cfg = to_objects(compose("+experiment=sweep_lr"))
    assert cfg.run.name == "sweep_lr" and cfg.cost.pricing == "spot" and cfg.model.n_layer == 18
    assert cfg.trainer.max_steps == cfg.optim.total_steps == 2000 and cfg.checkpoint.every_n_steps == 200
    assert cfg.early_stopping.patience and cfg.early_stopping.budget_usd
    assert cfg.phases.phases[-1].end_step == 2000


def test_optuna_sweeper_config_is_tpe_over_a_log_uniform_lr():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweeper = compose_with_hydra("hydra/sweeper=lm_optuna").hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "minimize"
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler"
    assert sweeper.params["optim.lr"] == "tag(log, interval(1.0e-4, 3.0e-3))"


@pytest.mark.slow  # 14-22 s on 2 cores: headroom under the README command's 10 min
def test_optuna_sweeper_runs_two_tpe_trials_into_the_summary(tmp_path, data_cache):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    overrides = [*TINY, f"run.root={tmp_path}", f"data.cache_dir={data_cache}", "run.name=tpe"]
    overrides += ["trainer.max_steps=2", "trainer.val_every_steps=2", "hydra.sweeper.n_trials=2"]
    cmd = [sys.executable, "train.py", "-m", "hydra/sweeper=lm_optuna", *overrides]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(tmp_path / "tpe" / "sweep_summary.csv")
    assert len(rows) == 2 and all(r["status"] == "completed" for r in rows)
    assert all(r["job"].startswith("optim.lr=") and 1e-4 <= float(r["optim.lr"]) <= 3e-3 for r in rows)
    best = yaml.safe_load((tmp_path / "tpe" / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(float(rows[0]["val_loss"]), rel=1e-6)


# --- SkyPilot ----------------------------------------------------------------------------------------------


def plan_1b(compose, *extra: str):
    return to_objects(compose("+experiment=plan_1b", *extra))


def test_gpus_rank_by_dollars_per_token_and_memory_fit(compose):
    cfg = plan_1b(compose)
    ranked = rank_gpus(cfg.model, cfg.data, cfg.activation_checkpointing.every, load_catalog(conf_dir()))
    per_b = [c.usd_per_billion_tokens for c in ranked if c.usd_per_billion_tokens is not None]
    assert per_b == sorted(per_b) and len(per_b) >= 8
    h100 = next(c for c in ranked if c.gpu.name == "h100_sxm")
    fpt = flops_per_token(cfg.model, cfg.data.seq_len, non_embedding_params(cfg.model))
    expected = 1.49 / 3600 / (989.4e12 * ASSUMED_MFU / fpt) * 1e9  # spot price, catalog peak
    assert h100.pricing == "spot" and h100.usd_per_billion_tokens == pytest.approx(expected)
    # lm.numbers.memory's estimate for 8 x 2048 tokens without checkpointing: 80 GB cards fit, 48 GB ones do not.
    assert 48 < h100.need_gb < 0.9 * 80 and h100.why_not is None
    assert "needs ~" in next(c for c in ranked if c.gpu.name == "l40s").why_not
    # Activation checkpointing frees the memory: the cheapest card per token becomes the first candidate.
    on_cfg = plan_1b(compose, "activation_checkpointing=on")
    on = rank_gpus(on_cfg.model, on_cfg.data, on_cfg.activation_checkpointing.every, load_catalog(conf_dir()))
    assert next(c.gpu.name for c in on if c.why_not is None) == "l40s"
    assert memory_needed_gb(on_cfg.model, on_cfg.data, on_cfg.activation_checkpointing.every) < h100.need_gb


def test_committed_sky_task_is_generated_from_the_catalog(compose):
    cfg = plan_1b(compose)
    ranked = rank_gpus(cfg.model, cfg.data, cfg.activation_checkpointing.every, load_catalog(conf_dir()))
    text = render_task(["+experiment=plan_1b"], ranked)
    assert (ROOT / "sky/train.yaml").read_text() == text, "stale: run `lm sky` and commit sky/train.yaml"
    task = yaml.safe_load(text)
    wanted = [f"{c.sky_name}:1" for c in ranked if c.why_not is None]
    assert [r["accelerators"] for r in task["resources"]["ordered"]] == wanted
    assert wanted[0] == "H100:1" and task["resources"]["use_spot"] is True
    assert task["run"].index("lm selftest") < task["run"].index("lm supervise")  # minutes before the hours


def test_sky_task_matches_skypilot_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schemas = json.loads((ROOT / "tests/fixtures/skypilot_schemas.json").read_text())
    task = yaml.safe_load((ROOT / "sky/train.yaml").read_text())
    jsonschema.validate(task, schemas["task"])
    jsonschema.validate(task["resources"], schemas["resources"])
    assert "file_mounts" not in task  # checkpoints go to the bucket through lm's checkpoint.remote
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**task["resources"], "use_spott": True}, schemas["resources"])


def test_sky_task_loads_with_skypilots_own_loader():
    # The `sky` extra is not in dev (it pins click<8.2 against datasets'). Without it, `import sky` finds
    # this repository's own sky/ folder as a namespace package, so ask for a module only SkyPilot has.
    pytest.importorskip("sky.task", reason="SkyPilot is not installed: pip install -e '.[sky]'")
    import sky

    task = sky.Task.from_yaml(str(ROOT / "sky/train.yaml"))
    assert [next(iter(r.accelerators)) for r in task.resources] == ["H100", "H200", "A100-80GB"]
    assert all(r.use_spot for r in task.resources)
    assert task.envs["CKPT_BUCKET"] == "lm-checkpoints"
    assert "lm supervise -- python train.py +experiment=plan_1b" in task.run
    assert "checkpoint.remote=s3://$CKPT_BUCKET/runs" in task.run
    assert "pip install" in task.setup
