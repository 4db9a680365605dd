"""The batch-size ramp (`data.batch_ramp_steps`): its arithmetic, the sampler's order, and a real run's tokens
and exact resume across the ramp."""

import json
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest

from lm.base.exits import EXIT_PREEMPTED, Refused
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.milestones import MilestoneCallback
from lm.checkpoint.run_state import RunState
from lm.config import DataConfig, MixtureSource, OptimConfig, PhaseConfig, TrainerConfig, conf_dir, to_objects
from lm.data.dataset import StepSampler
from lm.numbers.batch_ramp import BatchRamp
from lm.numbers.cost import load_catalog
from lm.numbers.run_plan import resolve
from lm.tools import budget
from lm.tools.ablate import arm_shape

from ..conftest import TINY
from ..harness import assert_matches_reference, fault, last, run
from .test_cost import series

RAMPS = [
    BatchRamp(16, 8, 2, 3, steps=100, start=0.25),
    BatchRamp(16, 1, 1, 1, steps=7, start=0.1),  # 4 stages over 7 steps
    BatchRamp(5, 3, 1, 2, steps=10, start=0.3),  # rows rounded: 2, 3, 5
    BatchRamp(3, 1, 1, 1, steps=2, start=0.01),  # more stages than steps: the empty ones left out
    BatchRamp(16, 4, 2, 1, steps=0),  # off
    BatchRamp(16, 4, 1, 1, steps=50, start=1.0),  # start at the full batch: off
]


def brute_samples(ramp: BatchRamp, steps: int) -> int:
    return sum(ramp.batch_at(s) for s in range(steps))


@pytest.mark.parametrize("ramp", RAMPS, ids=str)
def test_closed_forms_match_a_loop_over_steps(ramp):
    for steps in range(0, ramp.steps + 30):
        assert ramp.samples_before(steps) == brute_samples(ramp, steps)
        assert (
            ramp.tokens_through(steps)
            == brute_samples(ramp, steps) * ramp.seq_len * ramp.accumulate * ramp.world
        )
        assert ramp.tokens_of(steps) == ramp.tokens_through(steps + 1) - ramp.tokens_through(steps)
    assert all(ramp.batch_at(s) == ramp.batch_size for s in range(ramp.steps, ramp.steps + 30))


@pytest.mark.parametrize("ramp", RAMPS, ids=str)
def test_steps_for_tokens_is_the_fewest_steps_reaching_them(ramp):
    for tokens in range(0, ramp.tokens_through(ramp.steps + 5), max(1, ramp.seq_len // 2)):
        n = ramp.steps_for_tokens(tokens)
        assert ramp.tokens_through(n) >= tokens
        assert n == 0 or ramp.tokens_through(n - 1) < tokens
    assert ramp.steps_for_tokens(ramp.tokens_through(37)) == 37


def test_the_ramp_doubles_in_even_stages_up_to_the_full_batch():
    ramp = BatchRamp(16, steps=100, start=0.25)
    assert ramp.stages == ((0, 4), (50, 8), (100, 16))
    assert [ramp.batch_at(s) for s in (0, 49, 50, 99, 100, 10**6)] == [4, 4, 8, 8, 16, 16]
    assert BatchRamp(16, steps=8, start=0.1).stages == ((0, 2), (2, 3), (4, 6), (6, 13), (8, 16))
    assert "4 from step 0 -> 8 from step 50 -> 16 from step 100" in ramp.describe()


@pytest.mark.parametrize("steps", [0, 1, 9, 1000])
def test_off_is_exactly_steps_times_tokens_per_step(steps):
    for ramp in (BatchRamp(16, 256, 4, 8), BatchRamp(16, 256, 4, 8, steps=0, start=0.5)):
        assert ramp.tokens_through(steps) == steps * ramp.tokens_per_step == steps * 16 * 256 * 4 * 8
        assert ramp.steps_for_tokens(steps * ramp.tokens_per_step + 1) == steps + 1


def test_the_plan_counts_the_ramp():
    trainer, optim = TrainerConfig(max_steps=300, accumulate_grad_batches=2), OptimConfig()
    off = resolve(DataConfig(batch_size=16, seq_len=32), trainer, optim, world=2)
    assert off.end.tokens == 300 * off.tokens_per_step and off.end_steps == 300
    data = DataConfig(batch_size=16, seq_len=32, batch_ramp_steps=100)
    plan = resolve(data, trainer, optim, world=2)
    per_row = 32 * 2 * 2
    assert plan.end.tokens == (50 * 4 + 50 * 8 + 200 * 16) * per_row
    assert "batch ramp" in plan.end.source
    # A plan ending at a token count ends at the step the ramped steps reach it.
    phases = (PhaseConfig("all", end_tokens=plan.end.tokens),)
    assert resolve(data, trainer, optim, phases, world=2).end_steps == 300


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("batch_ramp_steps", -1, "data.batch_ramp_steps=-1 must be >= 0"),
        ("batch_ramp_start", 0.0, r"data.batch_ramp_start=0.0 must be in \(0, 1\]"),
        ("batch_ramp_start", 1.5, r"data.batch_ramp_start=1.5 must be in \(0, 1\]"),
    ],
)
def test_bad_ramp_keys_are_refused_by_name(key, value, match):
    with pytest.raises(Refused, match=match):
        DataConfig(**{"batch_ramp_steps": 10, key: value})


def test_a_mixture_refuses_the_ramp():
    with pytest.raises(Refused, match="not supported with data.mixture.*data.batch_ramp_steps=0"):
        DataConfig(batch_ramp_steps=10, mixture=[MixtureSource("a", dir="x")])


# -- the sampler --------------------------------------------------------------------------------------------


def take(sampler: StepSampler, n: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def old_order(n_windows, batch, seed, start, accumulate, world, rank, skips, n):
    """StepSampler's order before the ramp, verbatim: micro-batch m takes (m x world + rank) x batch on."""
    s = StepSampler(
        n_windows, batch, seed=seed, accumulate=accumulate, world_size=world, rank=rank, skips=skips
    )
    out, step = [], start
    while len(out) < n:
        first = s.stream_step(step) * accumulate
        out += [s.micro_batch(m) for m in range(first, first + accumulate)]
        step += 1
    return out[:n]


@pytest.mark.parametrize(
    "start, accumulate, world, rank, skips",
    [
        (0, 1, 1, 0, ()),
        (5, 2, 1, 0, ()),
        (3, 2, 4, 3, ()),
        (0, 3, 2, 1, [(4, 6), (10, 10)]),
        (8, 1, 1, 0, [(2, 3)]),
    ],
)
def test_without_the_ramp_the_order_is_exactly_todays(start, accumulate, world, rank, skips):
    args = dict(seed=7, accumulate=accumulate, world_size=world, rank=rank, skips=skips)
    new = take(StepSampler(53, 4, start_step=start, **args), 60)
    assert new == old_order(53, 4, 7, start, accumulate, world, rank, skips, 60)
    off = BatchRamp(4, steps=0)
    assert take(StepSampler(53, 4, start_step=start, ramp=off, **args), 60) == new


def ramped(start_step=0, rank=0, world=1, skips=()) -> StepSampler:
    ramp = BatchRamp(8, steps=6, start=0.25)  # 2 rows for steps 0-2, 4 for 3-5, 8 from 6
    return StepSampler(
        10_000,
        8,
        seed=3,
        start_step=start_step,
        accumulate=2,
        world_size=world,
        rank=rank,
        skips=skips,
        ramp=ramp,
    )


def test_ramped_batches_grow_and_resume_exactly():
    full = take(ramped(), 2 * 12)
    assert [len(b) for b in full[::2]] == [2, 2, 2, 4, 4, 4, 8, 8, 8, 8, 8, 8]
    for k in range(12):  # started at step k = advanced to step k
        assert take(ramped(start_step=k), 2 * (12 - k)) == full[2 * k :]


def test_ramped_samples_neither_overlap_nor_skip():
    """Within an epoch (10,000 windows) every sample index is a distinct window: ranks x micro-batches x steps
    over the ramp's boundaries cover the stream's first samples exactly once."""
    world, steps = 3, 10
    seen = [i for r in range(world) for b in take(ramped(rank=r, world=world), 2 * steps) for i in b]
    ramp = BatchRamp(8, steps=6, start=0.25)
    assert len(seen) == len(set(seen)) == ramp.samples_before(steps) * 2 * world
    sampler = ramped()
    assert sorted(seen) == sorted(sampler.samples(0, len(seen)))


def test_skipped_windows_skip_the_ramped_steps_samples():
    plain = take(ramped(), 2 * 12)
    skipped = take(ramped(skips=[(2, 4)]), 2 * 9)
    assert skipped[:4] == plain[:4]  # steps 0-1
    # Step 2 starts where step 5 did (the samples after steps 2-4), with step 2's rows.
    assert [len(b) for b in skipped[4:6]] == [2, 2]
    step5 = [i for b in plain[10:12] for i in b]
    assert [i for b in skipped[4:6] for i in b] == step5[:4]
    assert take(ramped(start_step=5, skips=[(2, 4)]), 8) == skipped[10:18]  # and resumes exactly


# -- a real run ---------------------------------------------------------------------------------------------


class BatchRows(pl.Callback):
    """Test-only: the rows of every training micro-batch, written to `path` at the end of training."""

    def __init__(self, path: str) -> None:
        self.path, self.rows = Path(path), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rows.append(int(batch.shape[0]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.path.write_text(json.dumps(self.rows))


STEPS = 12
RAMP_RUN = [
    f"trainer.max_steps={STEPS}",
    f"optim.total_steps={STEPS}",
    "optim.warmup_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_steps=100",
    "+trainer.extra.num_sanity_val_steps=0",
    "checkpoint.every_n_steps=100",
    "data.batch_ramp_steps=8",  # batch_size 8: 2 rows for steps 0-3, 4 for 4-7, 8 from 8
]


def ramp_args(root: Path, cache: Path, name: str, *extra: str) -> list[str]:
    rows = "+callbacks.rows"
    return [
        *TINY,
        f"run.root={root}",
        f"data.cache_dir={cache}",
        f"run.name={name}",
        *RAMP_RUN,
        f"{rows}._target_=tests.numbers.test_batch_ramp.BatchRows",
        f"{rows}.path={root / name / 'rows.json'}",
        *extra,
    ]


@pytest.mark.slow
def test_a_ramped_run_counts_its_tokens_and_resumes_bitwise_across_the_ramp(tmp_path, data_cache):
    ramp = BatchRamp(8, seq_len=64, steps=8)
    (tmp_path / "reference").mkdir()
    ref = run(ramp_args(tmp_path, data_cache, "reference"))
    assert ref.code == 0, ref.tail()
    rows = json.loads((tmp_path / "reference" / "rows.json").read_text())
    assert rows == [ramp.batch_at(s) for s in range(STEPS)] == [2] * 4 + [4] * 4 + [8] * 4
    assert json.loads((tmp_path / "reference" / "cost.json").read_text())["tokens"] == ramp.tokens_through(
        STEPS
    )
    logged = series(tmp_path / "reference", "train/tokens")  # stamped at step - 1
    assert {s + 1: int(v) for s, v in logged.items()} == {
        s: ramp.tokens_through(s) for s in range(1, STEPS + 1)
    }
    reference = last(tmp_path, "reference")

    name = "cut"  # SIGTERM at the start of step 5 saves step 6, inside the ramp's second stage
    (tmp_path / name).mkdir()
    cmd = ramp_args(tmp_path, data_cache, name, *fault(tmp_path / name, "sigterm", step=5))
    first = run(cmd)
    assert first.code == EXIT_PREEMPTED, first.tail()
    assert last(tmp_path, name)["global_step"] == 6
    again = run(cmd)
    assert again.code == 0, again.tail()
    assert_matches_reference(tmp_path, name, reference, steps=STEPS)
    assert json.loads((tmp_path / name / "cost.json").read_text())["tokens"] == ramp.tokens_through(STEPS)


def test_a_phase_ending_at_a_token_count_is_one_milestone_with_the_ramp(tmp_path):
    """The tokens before a step are the ramp's, not a full step's: a phase ending at tokens_through(5) is a
    milestone at step 5 only (with a full step subtracted, step 6 would look like a boundary again)."""
    ramp = BatchRamp(8, steps=8)  # 2 tokens a step for steps 0-3, 4 for 4-7, 8 from 8
    meter = CostMeter(
        tokens_per_device_step=8,
        flops_per_token=1.0,
        peak_flops=None,
        price_per_hour=None,
        log_every=1,
        ramp=ramp,
        run_state=RunState(),
    )
    phases = [PhaseConfig("warm", end_tokens=ramp.tokens_through(5)), PhaseConfig("rest", end_step=100)]
    cfg = SimpleNamespace(steps=[], at_phase_ends=True, at_last_step=False)
    milestones = MilestoneCallback(cfg, phases, meter, tmp_path)
    found = [s for s in range(1, 12) if milestones.is_milestone(s, ramp.tokens_through(s))]
    assert found == [5]
    assert milestones.phase_name(5, ramp.tokens_through(5)) == "warm"
    assert milestones.phase_name(6, ramp.tokens_through(6)) == "rest"


def test_lm_plan_counts_the_ramps_steps_by_their_tokens(tiny_cfg, tmp_path):
    """A dollar budget buys the same tokens with the ramp, in more (smaller) steps; the experiment it writes
    carries the ramp, so the run trains what was priced."""
    cfg = to_objects(tiny_cfg())
    presets = {"tiny": budget.load_presets(conf_dir(), cfg.data)["tiny"]}
    cpu = load_catalog(conf_dir())["cpu"]

    def plan(goal, **ramp):
        (p,) = budget.make_plans(
            goal, presets, [cpu], seq_len=64, tokens_per_step=512, corpus=10**6, tokens_per_sec=20_000.0,
            price_per_hour=100.0, **ramp,
        )  # fmt: skip
        return p

    off, on = plan(budget.Goal(usd=1.0)), plan(budget.Goal(usd=1.0), ramp_steps=400)
    assert off.steps == 1406 and off.tokens == 1406 * 512  # $1 at $100/h = 36 s = 720,000 tokens
    assert on.tokens == on.ramp.tokens_through(on.steps) <= 720_000 < on.ramp.tokens_through(on.steps + 1)
    assert on.steps == 1406 + 250  # 200 steps at 1/4 and 200 at 1/2 of the batch: 150 full steps' tokens
    assert on.usd_on_demand == pytest.approx(on.tokens / 20_000 * 100 / 3600)
    text = budget.experiment_yaml(on, "ramped", "lm plan")
    assert "batch ramp:" in text
    (tmp_path / "extra" / "experiment").mkdir(parents=True)
    (tmp_path / "extra" / "experiment" / "ramped.yaml").write_text(text)
    composed = to_objects(tiny_cfg(f"hydra.searchpath=[file://{tmp_path / 'extra'}]", "+experiment=ramped"))
    assert (composed.data.batch_ramp_steps, composed.trainer.max_steps) == (400, on.steps)
    target = plan(budget.Goal(target_loss=off.loss), ramp_steps=400)
    assert target.tokens >= off.tokens - 512  # a target loss buys at least the tokens it needs


def test_lm_ablate_counts_a_ramped_arms_tokens():
    """An ablation arm with the ramp trains fewer tokens in its steps: its curve's tokens, the baseline's
    tokens and the modelled dollars are the ramp's, not steps x tokens per step."""
    base = ["model=tiny", "trainer.max_steps=300", "trainer.val_every_steps=30"]
    plain, ramped_arm = arm_shape(base), arm_shape([*base, "data.batch_ramp_steps=100"])
    assert plain.tokens_through(300) == 300 * plain.tokens_per_step
    per_row = ramped_arm.tokens_per_step // ramped_arm.ramp.batch_size
    assert ramped_arm.tokens_through(300) == (50 * 4 + 50 * 8 + 200 * 16) * per_row
