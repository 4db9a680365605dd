"""One plan arithmetic: `lm prepare`, the doctor, the data module and the stopper read the same numbers."""

import pytest

from lm.cli import main as lm
from lm.config import to_objects
from lm.numbers import run_plan
from lm.run.doctor import check_plan, resolve_target

PHASE1 = ["+experiment=phase1", "trainer.accelerator=cpu"]
TOKENS_PER_STEP = 8 * 2048 * 8  # the 1B plan: batch 8 x seq 2048 x accumulation 8
PLAN_TOKENS = 90_000 * TOKENS_PER_STEP  # 11,796,480,000: phase 1 stops at 200 steps, the plan at 90K


def resolve(cfg):
    return run_plan.resolve(cfg.data, cfg.trainer, cfg.optim, cfg.phases.phases)


def test_the_plan_ends_where_the_schedule_and_phases_do_not_where_this_invocation_stops(compose):
    cfg = to_objects(compose(*PHASE1))
    end = resolve(cfg).end
    assert cfg.trainer.max_steps == 200
    assert (end.tokens, end.steps) == (PLAN_TOKENS, 90_000) and "90,000" in end.source


@pytest.mark.parametrize(
    ("overrides", "world"),
    [
        ([], 1),
        (["trainer.devices=8"], 8),
        (["trainer.devices=[0,1,2,3]", "trainer.num_nodes=2"], 8),
        (["trainer.devices=2", "trainer.num_nodes=4"], 8),
        (["trainer.devices=auto"], 1),  # no GPU here: one process
    ],
)
def test_a_step_counts_every_device_of_the_job(compose, overrides, world):
    cfg = to_objects(compose(*PHASE1, *overrides))
    assert run_plan.world_size(cfg.trainer) == world
    assert resolve(cfg).tokens_per_step == TOKENS_PER_STEP * world
    assert resolve(cfg).end.tokens == PLAN_TOKENS * world
    # The doctor reads the same number (it used to count one device whatever trainer.devices said).
    (finding,) = check_plan(resolve_target(cfg))
    assert f"{PLAN_TOKENS * world:,} tokens" in finding.what


def test_prepare_and_the_doctor_plan_the_same_tokens(compose, tmp_path, data_cache, capsys):
    """`lm prepare +experiment=phase1` used to plan 200 steps (26,214,400 tokens) where the doctor planned
    the 90K-step plan, so its repeated-data warning never showed."""
    args = [*PHASE1, f"data.cache_dir={data_cache}", "data.max_bytes=300000", "data.vocab_size=512"]
    args += ["data.tokenizer_sample_bytes=100000", f"run.root={tmp_path}"]
    lm(["prepare", *args])
    out = capsys.readouterr().out
    (finding,) = check_plan(resolve_target(to_objects(compose(*args))))
    assert f"trains on {PLAN_TOKENS:,} tokens" in out and f"{PLAN_TOKENS:,} tokens" in finding.what
    assert "repeated data" in out  # 11.8B tokens of a 300 KB corpus
