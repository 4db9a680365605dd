"""`lm plan`: its arithmetic agrees with the cost meter of a real run, the experiment it writes composes and
trains, a corpus not prepared yet is planned on an estimate of its size that says so, and a budget it cannot
spend, an unknown GPU or a streamed corpus not prepared get a clear error."""

import dataclasses
import json

import numpy as np
import pytest

from lm.cli import main as lm
from lm.config import conf_dir, to_objects
from lm.data import prepare
from lm.data.manifest import MANIFEST, TOKENIZER, load_manifest
from lm.numbers.cost import load_catalog
from lm.numbers.loss_law import BESIROGLU
from lm.numbers.reference import Curve, curve_key, mismatch
from lm.run.train import main
from lm.tools import budget, corpus_size, sibling

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
    hours, usd = budget.run_cost(meter["tokens"], meter["tokens"] / seconds, 36.0)
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
    # A name no user picks: the checkout's own conf/experiment/planned.yaml (what `lm plan` writes) would win.
    name = "lm_test_planned"
    (experiments / f"{name}.yaml").write_text(budget.experiment_yaml(plan, name, "lm plan --usd 1"))
    composed = tiny_cfg(f"hydra.searchpath=[file://{tmp_path / 'extra'}]", f"+experiment={name}")
    run_cfg = to_objects(composed)
    assert run_cfg.optim.total_steps == plan.steps == run_cfg.phases.phases[-1].end_step
    assert [p.name for p in run_cfg.phases.phases] == ["warm-up", "stable", "decay"]
    main(
        tiny_cfg(
            f"hydra.searchpath=[file://{tmp_path / 'extra'}]", f"+experiment={name}", "trainer.max_steps=3"
        )
    )
    meter = json.loads((tmp_path / "runs" / name / "cost.json").read_text())
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
        (
            ["--usd", "100", "data=hf", "data.name=HuggingFaceFW/fineweb-edu"],
            "cannot be estimated without reading it: run `lm prepare",
        ),
    ],
    ids=["budget below one step", "unknown gpu", "unreachable loss", "hf corpus not prepared"],
)
def test_bad_input_gets_a_clear_error(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        lm(["plan", "--out-dir", str(tmp_path), *args, f"data.cache_dir={tmp_path / 'empty-cache'}"])
    assert message in str(e.value)
    assert not list(tmp_path.glob("*.yaml"))  # nothing written


@pytest.mark.slow  # 26-74 s on 2 cores: the README command stays under 10 min
def test_plan_never_overwrites_an_experiment_it_did_not_write(tmp_path, capsys):
    args = [
        "plan",
        "--usd",
        "100",
        "--gpu",
        "h100_sxm",
        "--corpus-tokens",
        "100000000",
        "--out-dir",
        str(tmp_path),
    ]
    (tmp_path / "phase1.yaml").write_text("# @package _global_\n# the project's own experiment\n")
    with pytest.raises(SystemExit) as e:
        lm([*args, "--name", "phase1"])
    assert "was not written by `lm plan`" in str(e.value) and "--name" in str(e.value)
    assert (tmp_path / "phase1.yaml").read_text().endswith("the project's own experiment\n")
    lm(args)  # its own file, written and then rewritten
    lm(args)
    assert (tmp_path / "planned.yaml").read_text().splitlines()[1].startswith("# Written by `lm plan")


def test_plan_on_a_corpus_not_prepared_estimates_its_size_and_says_so(tmp_path, capsys):
    cache = tmp_path / "empty-cache"
    lm(["plan", "--usd", "100", "--gpu", "h100_sxm", "--out-dir", str(tmp_path), f"data.cache_dir={cache}"])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("corpus: ~") and "training tokens, an ESTIMATE: " in first
    assert "MB of raw sources" in first and "the default for a byte-level BPE of 4,096 tokens" in first
    assert "epochs: of the corpus's ~" in out  # under the table, whose epochs read ~0.53
    assert "training tokens, an ESTIMATE: " in (tmp_path / "planned.yaml").read_text()
    assert not cache.exists()  # nothing was prepared to plan


def test_the_estimate_measures_the_runs_tokenizer_and_a_prepared_corpus_is_exact(tiny_cfg, tmp_path):
    data = dataclasses.replace(to_objects(tiny_cfg()).data, cache_dir=str(tmp_path / "cache"))
    default = corpus_size.corpus_size(data)  # no tokenizer yet: the default bytes per token at 512 tokens
    folder = prepare(data)
    exact = corpus_size.corpus_size(data)
    assert not exact.estimated and exact.tokens == load_manifest(folder)["splits"]["train"]["tokens"]
    assert not str(exact).startswith("~") and "exact: the manifest of" in str(exact)
    (
        folder / MANIFEST
    ).unlink()  # as an interrupted `lm prepare` leaves it: the tokenizer trained, no manifest
    interrupted = corpus_size.corpus_size(data)
    configured = corpus_size.corpus_size(
        dataclasses.replace(data, tokenizer=str(folder / TOKENIZER), cache_dir=str(tmp_path / "other"))
    )
    assert "the default for a byte-level BPE of 512 tokens" in default.how
    assert "measured on a 1.0 MB sample with the tokenizer `lm prepare` trained in" in interrupted.how
    assert f"measured on a 1.0 MB sample with data.tokenizer={folder / TOKENIZER}" in configured.how
    for estimate, within in [(default, 0.15), (interrupted, 0.05), (configured, 0.05)]:
        assert estimate.estimated and str(estimate).startswith(
            f"~{estimate.tokens:,} training tokens, an ESTIMATE"
        )
        assert abs(estimate.tokens - exact.tokens) < within * exact.tokens, (estimate, exact)


@pytest.mark.slow  # 26-74 s on 2 cores: the README command stays under 10 min
def test_a_small_corpus_is_not_planned_as_if_every_token_were_fresh(capsys, tmp_path):
    """The bundled corpus's 9.4M tokens and $150: no plan past ~47 epochs, and a plan past 4 says its cost."""
    corpus = 9_411_377
    lm(["plan", "--usd", "150", "--corpus-tokens", str(corpus), "--out-dir", str(tmp_path), "--top", "30"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    assert rows
    epochs = [float(r[9]) for r in rows]
    assert (
        max(epochs) <= budget.WORTHWHILE_EPOCHS + 0.5
    )  # the budget buys no tokens past the worthwhile epochs
    for row, e in zip(rows, epochs, strict=True):
        repeats = next(c for c in row if c.startswith("+"))
        assert repeats.endswith("!") == (e > 4)  # past ~4 epochs the row says so, with its loss
    assert "Muennighoff et al. 2023" in out
    written = (tmp_path / "planned.yaml").read_text()
    assert "repetition costs" in written


@pytest.mark.slow  # ~40 s alone: three real runs, the sibling's 78 steps validated 20 times
def test_the_sibling_shares_the_forecasts_key_and_becomes_the_plans_reference(tiny_cfg, tmp_path, caplog):
    """`lm plan --sibling`: the plan at half the width and the same tokens per parameter, step and schedule
    shape. Before the sibling has run, the plan trains and says the reference is missing; once it has, the
    plan's forecast reads the sibling's curve, and forecast.json names it."""
    cfg = to_objects(tiny_cfg())
    (plan,) = tiny_plans(cfg, budget.Goal(usd=0.2), tokens_per_sec=20_000.0, price=100.0)
    small, warmup = sibling.make_sibling(plan, BESIROGLU, 1_000_000, cfg.data.seq_len)
    assert small.model.head_dim == plan.model.head_dim and small.model.d_model * 2 == plan.model.d_model
    assert (small.tokens_per_step, small.micro_batch, small.accumulate) == (
        plan.tokens_per_step,
        plan.micro_batch,
        plan.accumulate,
    )
    per_param = lambda p: p.tokens / p.params  # noqa: E731
    assert per_param(small) == pytest.approx(per_param(plan), abs=plan.tokens_per_step / small.params)
    assert small.usd_on_demand < plan.usd_on_demand / 4
    experiments = tmp_path / "extra" / "experiment"
    experiments.mkdir(parents=True)
    name = "lm_test_sibling_plan"
    (experiments / f"{name}.yaml").write_text(
        budget.experiment_yaml(plan, name, "lm plan", extra=sibling.reference_lines(f"{name}_sibling"))
    )
    (experiments / f"{name}_sibling.yaml").write_text(
        sibling.sibling_yaml(small, warmup, f"{name}_sibling", name, "lm plan", None)
    )
    search = (f"hydra.searchpath=[file://{tmp_path / 'extra'}]", "sampling=off", "data.num_workers=0")
    big_cfg, small_cfg = (
        to_objects(tiny_cfg(*search, f"+experiment={n}")) for n in (name, f"{name}_sibling")
    )
    assert small_cfg.model.d_model == small.model.d_model and small_cfg.trainer.max_steps == small.steps
    keys = [
        curve_key(c.optim, c.optim.total_steps, c.data.batch_size * c.data.seq_len, c.data)
        for c in (big_cfg, small_cfg)
    ]
    assert mismatch(Curve("sibling", np.array([1, 2]), np.array([1.0, 1.0]), 2, keys[1]), keys[0]) is None
    with caplog.at_level("WARNING", logger="lm.run.references"):
        main(tiny_cfg(*search, f"+experiment={name}", "trainer.max_steps=3"))
    assert "no such run directory" in caplog.text and f"{name}_sibling" in caplog.text
    main(tiny_cfg(*search, f"+experiment={name}_sibling"))
    main(tiny_cfg(*search, f"+experiment={name}", f"trainer.max_steps={plan.steps * 3 // 10}"))
    said = json.loads((tmp_path / "runs" / name / "forecast.json").read_text())["reference"]
    assert said["reference"] == str(tmp_path / "runs" / f"{name}_sibling")
    assert said["fraction"] == pytest.approx(0.3, abs=0.05)
