"""`lm plan --sibling` always writes a sibling its plan accepts as the forecast's reference (issue 48 item 6): the
key compares the configured tokens per step, the warm-up, batch ramp and sequence-length warm-up as fractions of
each run, and the optimizer; the sibling's steps are chosen so that its whole-step warm-up and ramp land on the
plan's fractions."""

import dataclasses

import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from lm.base.exits import Refused
from lm.config import DataConfig, OptimConfig, to_objects
from lm.numbers.batch_ramp import BatchRamp, ramp_of
from lm.numbers.loss_law import BESIROGLU
from lm.numbers.reference import Curve, curve_key, mismatch
from lm.run.references import load_references, read_reference, typed
from lm.store import rundir
from lm.tools import budget, sibling

from .test_planner import tiny_plans


def key_of(text: str) -> dict:
    """The forecast key of an experiment file `lm plan` wrote, its sections read into their schemas (defaults
    for the rest, as a run composes them)."""
    raw = yaml.safe_load(text)
    optim, data = OptimConfig(**raw["optim"]), DataConfig(**raw["data"])
    per_step = data.batch_size * data.seq_len * raw["trainer"]["accumulate_grad_batches"]
    return curve_key(optim, optim.total_steps, per_step, data)


@pytest.fixture
def plan(tiny_cfg):
    cfg = to_objects(tiny_cfg())
    (p,) = tiny_plans(cfg, budget.Goal(usd=0.2), tokens_per_sec=20_000.0, price=100.0)
    return p


def test_every_sibling_shares_its_plans_key_whatever_the_plans_length_and_ramp(plan):
    """Before: a plan under ~380 steps got a sibling whose rounded warm-up left the 10% tolerance (a 45-step
    sibling warmed up 2 steps, 4.4% against 5%), and a ramp was rounded the same way; the plan then refused to
    start after the sibling was paid for."""
    refused = []
    for steps in (
        45,
        61,
        97,
        133,
        181,
        229,
        301,
        377,
        613,
        1201,
    ):  # each make_sibling builds two models: ~0.1 s
        for ramp_steps in (None, 5, 100):
            ramp = None
            if ramp_steps is not None:
                ramp = BatchRamp(
                    plan.micro_batch, plan.model.max_seq_len, plan.accumulate, 1, ramp_steps, 0.25
                )
            p = dataclasses.replace(plan, steps=steps, ramp=ramp)
            small, warmup = sibling.make_sibling(p, BESIROGLU, 1_000_000, plan.model.max_seq_len)
            plan_key = key_of(budget.experiment_yaml(p, "p", "lm plan"))
            small_key = key_of(sibling.sibling_yaml(small, warmup, "p_sibling", "p", "lm plan", None))
            said = mismatch(Curve("p_sibling", [1.0, 2.0], [1.0, 1.0], 2, small_key), plan_key)
            if said:
                refused.append((steps, ramp_steps, said))
    assert not refused, refused[:3]


def test_the_sibling_keeps_the_plans_tokens_per_parameter_where_the_rounding_allows(plan):
    p = dataclasses.replace(plan, steps=4000, ramp=None)
    small, warmup = sibling.make_sibling(p, BESIROGLU, 1_000_000, plan.model.max_seq_len)
    target = round(p.steps * small.params / p.params)
    assert abs(small.steps - target) <= 10 and warmup / small.steps == pytest.approx(0.05, rel=sibling.MATCH)
    # A 2% warm-up cannot be 0.8 of a step: a sibling aimed at 40 steps trains the nearest count that matches.
    assert sibling.matched_steps(40, [0.02], 10_000) == 48
    assert sibling.matched_steps(500, [0.02, 0.0], 10_000) == 500


def test_the_matched_steps_land_every_fraction_inside_the_keys_tolerance():
    """The rounding alone, over plans of 40-20,000 steps with and without a ramp: the warm-up (budget's 5%,
    at most 2,000 steps) and ramp of the sibling, as fractions of its run, always within the key's tolerance."""
    for plan_steps in range(40, 20_000, 113):
        w = budget.warmup_steps(plan_steps) / plan_steps
        for ramp in (0, 3, 50, 700):
            r = ramp / plan_steps
            for share in (0.05, 0.25, 0.5):
                s = sibling.matched_steps(round(share * plan_steps), [w, r], plan_steps)
                small = OptimConfig(warmup_steps=sibling.whole(w, s))
                big = OptimConfig(warmup_steps=budget.warmup_steps(plan_steps))
                ramped = lambda n: DataConfig(batch_ramp_steps=n) if n else DataConfig()  # noqa: E731
                a = curve_key(small, s, 512, ramped(sibling.whole(r, s) if ramp else 0))
                b = curve_key(big, plan_steps, 512, ramped(ramp))
                assert mismatch(Curve("s", [1.0, 2.0], [1.0, 1.0], 2, a), b) is None, (
                    plan_steps,
                    ramp,
                    share,
                    s,
                )


def write_run(run_dir, cfg, steps: int, world: int, losses=(4.0, 3.5, 3.2, 3.0)):
    """A finished run directory as lm writes it: its config.yaml and TensorBoard's `train/tokens` and
    `val/loss` (a step's scalars at the step before the trainer's global step)."""
    rundir.write_config(run_dir, cfg)
    cfg = rundir.read_config(run_dir)
    data = typed(cfg, "data", DataConfig)
    ramp = ramp_of(data, cfg.trainer.accumulate_grad_batches, world)
    with SummaryWriter(str(run_dir / rundir.TB)) as tb:
        for step in range(steps):
            tb.add_scalar("train/tokens", ramp.tokens_through(step + 1), step)
        every = steps // len(losses)
        for i, loss in enumerate(losses):
            tb.add_scalar("val/loss", loss, (i + 1) * every - 1)
    return cfg


@pytest.mark.parametrize("world", [1, 2])
def test_a_reference_trained_with_a_batch_ramp_keys_its_configured_tokens_per_step(tiny_cfg, tmp_path, world):
    """Before: the key read the tokens trained over the steps, an average under a ramp (433 of 512), and a
    reference with a ramp never matched a run with the same ramp."""
    cfg = tiny_cfg("trainer.max_steps=40", "optim.warmup_steps=2", "data.batch_ramp_steps=12")
    cfg = write_run(tmp_path / "ref", cfg, 40, world)
    data, optim = typed(cfg, "data", DataConfig), typed(cfg, "optim", OptimConfig)
    configured = data.batch_size * data.seq_len * world
    curve = read_reference(tmp_path / "ref")
    assert curve.key["tokens_per_step"] == configured
    assert curve.key["data.batch_ramp_fraction"] == pytest.approx(12 / 40)
    # The run keyed as build.py keys it (RunPlan.tokens_per_step), at twice the length: the same shape.
    longer = dataclasses.replace(optim, warmup_steps=4)
    run = curve_key(longer, 80, configured, dataclasses.replace(data, batch_ramp_steps=24))
    assert load_references([str(tmp_path / "ref")], run)[0].key["tokens_per_step"] == configured


@pytest.mark.parametrize(
    "field,change",
    [
        ("data.batch_ramp_fraction", {"data": {"batch_ramp_steps": 0}}),
        ("data.seq_len_warmup_fraction", {"data": {"seq_len_warmup_steps": 8}}),
        ("optim.name", {"optim": {"name": "muon"}}),
    ],
)
def test_a_reference_that_differs_in_ramp_seq_len_warmup_or_optimizer_is_refused(
    tiny_cfg, tmp_path, field, change
):
    """Before: the key ignored data.seq_len_warmup_steps, the batch ramp and optim.name, so such a reference
    was accepted silently."""
    cfg = tiny_cfg("trainer.max_steps=40", "optim.warmup_steps=2", "data.batch_ramp_steps=12")
    cfg = write_run(tmp_path / "ref", cfg, 40, 1)
    data, optim = typed(cfg, "data", DataConfig), typed(cfg, "optim", OptimConfig)
    data = dataclasses.replace(data, **change.get("data", {}))
    optim = dataclasses.replace(optim, **change.get("optim", {}))
    run = curve_key(optim, 40, data.batch_size * data.seq_len, data)
    with pytest.raises(Refused, match=f"differs from this run in {field}"):
        load_references([str(tmp_path / "ref")], run)
