"""`lm plan`: its arithmetic agrees with the cost meter of a real run, the experiment it writes composes and
trains, and a budget it cannot spend, an unknown GPU or a corpus not prepared get a clear error."""

import json

import pytest

from lm.cli import main as lm
from lm.config import conf_dir, to_objects
from lm.numbers.cost import load_catalog
from lm.run.train import main
from lm.tools import budget

CPU = load_catalog(conf_dir())["cpu"]


def tiny_plans(cfg, goal: budget.Goal, tokens_per_sec: float, price: float) -> list[budget.BudgetPlan]:
    """Plans of the tiny preset on the CPU at a measured throughput and a given price."""
    presets = budget.load_presets(conf_dir(), cfg.data)
    return budget.make_plans(
        goal,
        {"tiny": presets["tiny"]},
        [CPU],
        seq_len=cfg.data.seq_len,
        tokens_per_step=cfg.data.batch_size * cfg.data.seq_len,
        corpus=1_000_000,
        tokens_per_sec=tokens_per_sec,
        price_per_hour=price,
    )


def test_the_plan_prices_a_real_run_as_its_cost_meter_did(tiny_cfg, tmp_path):
    main(
        tiny_cfg(
            "trainer.max_steps=12", "trainer.val_every_steps=100", "sampling=off", "cost.price_per_hour=36"
        )
    )
    meter = json.loads((tmp_path / "runs" / "smoke" / "cost.json").read_text())
    cfg = to_objects(tiny_cfg())
    per_step = cfg.data.batch_size * cfg.data.seq_len
    assert meter["tokens"] == meter["step"] * per_step  # tokens = steps x tokens per step
    seconds = meter["seconds"]["train"]
    hours, usd = budget.run_cost(meter["step"], per_step, meter["tokens"] / seconds, 36.0)
    assert usd == pytest.approx(hours * 36.0) == pytest.approx(seconds * 36.0 / 3600.0)  # hours x price = $
    # Asked for the hours the run trained, at its throughput, the planner plans the run's steps and dollars.
    (plan,) = tiny_plans(cfg, budget.Goal(hours=seconds / 3600.0 * 1.0001), meter["tokens"] / seconds, 36.0)
    assert plan.steps == meter["step"] and plan.tokens == meter["tokens"]
    assert plan.usd_on_demand == pytest.approx(seconds * 36.0 / 3600.0, rel=1e-3)


def test_the_written_experiment_composes_and_runs_a_few_steps(tiny_cfg, tmp_path):
    cfg = to_objects(tiny_cfg())
    (plan,) = tiny_plans(cfg, budget.Goal(usd=1.0), tokens_per_sec=20_000.0, price=100.0)
    assert plan.steps == 1406  # $1 at $100/h = 36 s = 720,000 tokens = 1,406 steps of 512
    experiments = tmp_path / "extra" / "experiment"
    experiments.mkdir(parents=True)
    (experiments / "planned.yaml").write_text(budget.experiment_yaml(plan, "planned", "lm plan --usd 1"))
    composed = tiny_cfg(f"hydra.searchpath=[file://{tmp_path / 'extra'}]", "+experiment=planned")
    run_cfg = to_objects(composed)
    assert run_cfg.optim.total_steps == plan.steps == run_cfg.phases.phases[-1].end_step
    assert [p.name for p in run_cfg.phases.phases] == ["warm-up", "stable", "decay"]
    main(
        tiny_cfg(
            f"hydra.searchpath=[file://{tmp_path / 'extra'}]", "+experiment=planned", "trainer.max_steps=3"
        )
    )
    meter = json.loads((tmp_path / "runs" / "planned" / "cost.json").read_text())
    assert meter["step"] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--usd", "1e-9", "--gpu", "h100_sxm", "--corpus-tokens", "1000000"],
            "below the price of one optimizer step",
        ),
        (
            ["--usd", "100", "--gpu", "h100_sxmm", "--corpus-tokens", "1000000"],
            "unknown GPU h100_sxmm: use one of",
        ),
        (["--target-loss", "1.0", "--corpus-tokens", "1000000"], "below what any preset reaches"),
        (["--usd", "100"], "is not prepared yet: run `lm prepare"),
    ],
    ids=["budget below one step", "unknown gpu", "unreachable loss", "corpus not prepared"],
)
def test_bad_input_gets_a_clear_error(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        lm(["plan", *args, "--out-dir", str(tmp_path), f"data.cache_dir={tmp_path / 'empty-cache'}"])
    assert message in str(e.value)
    assert not list(tmp_path.glob("*.yaml"))  # nothing written
