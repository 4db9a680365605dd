"""`lm plan` in CORE: a budget's plans carry the CORE they buy, a CORE target is met at the stated
probability by the fewest tokens, the uncalibrated prior says so and refuses what it cannot promise, the
prices say their date; `lm core-map` calibrates the map on run directories."""

import json

import pytest
from torch.utils.tensorboard import SummaryWriter

from lm.base.exits import Refused
from lm.cli import main as lm
from lm.config import DataConfig, conf_dir
from lm.numbers import core_map
from lm.numbers.core_map import CoreMap, loss_sd
from lm.numbers.cost import load_catalog
from lm.numbers.loss_law import BESIROGLU
from lm.store import rundir
from lm.tools import budget, calibrate

H100 = load_catalog(conf_dir())["h100_sxm"]
CALIBRATED = CoreMap(5.24, 1.186, 0.0198, 0.05, 0.03, 0.017, "v1", True, "three test runs", 3)


def plans(goal: budget.Goal, core: CoreMap) -> list[budget.BudgetPlan]:
    data = DataConfig(vocab_size=32768, seq_len=2048)
    presets = budget.load_presets(conf_dir(), data)
    return budget.make_plans(
        goal,
        {k: presets[k] for k in ("134m", "1b")},
        [H100],
        seq_len=2048,
        tokens_per_step=131_072,
        corpus=100_000_000_000,
        core=core,
    )


def test_a_budget_s_plans_carry_the_core_they_buy_with_its_interval():
    prior = core_map.public_prior("v1")
    shown = plans(budget.Goal(usd=30), prior)
    for p in shown:
        assert p.core.low < p.core.core < p.core.high and p.core.version == "v1" and not p.core.calibrated
        assert p.core.core == pytest.approx(float(prior.mean(p.loss)))
    text = budget.render(shown, core=prior)
    assert "CORE v1 (90%)" in text and "UNCALIBRATED" in text and "lm core-map" in text
    assert f"price of h100_sxm: as of {H100.price_date}, https://" in text
    sure = plans(budget.Goal(usd=30), CALIBRATED)[0].core
    assert (
        sure.high - sure.low < shown[0].core.high - shown[0].core.low
    )  # a calibrated map's interval is narrower


def test_a_core_target_is_met_at_the_stated_probability_by_the_fewest_tokens():
    goal = budget.Goal(target_core=0.2565, confidence=0.9)
    shown = plans(goal, CALIBRATED)
    assert shown and [p.usd_on_demand for p in shown] == sorted(p.usd_on_demand for p in shown)
    for p in shown:
        assert p.p_target >= 0.9
        loss, low, high = budget.loss_interval(p.params, 0.97 * p.tokens, BESIROGLU, None, 100_000_000_000)
        assert CALIBRATED.probability_at_least(0.2565, loss, loss_sd(low, high)) < 0.9  # 3% fewer tokens miss
    assert "P(>=target)" in budget.render(shown, core=CALIBRATED)
    surer = plans(budget.Goal(target_core=0.2565, confidence=0.97), CALIBRATED)
    assert min(p.usd_on_demand for p in surer) > min(p.usd_on_demand for p in shown)


def test_the_uncalibrated_prior_refuses_a_promise_it_cannot_keep(tmp_path):
    with pytest.raises(SystemExit) as e:
        lm(["plan", "--target-core", "0.2565", "--gpu", "h100_sxm", "--corpus-tokens", "100000000000",
            "--out-dir", str(tmp_path)])  # fmt: skip
    assert "UNCALIBRATED" in str(e.value) and "lm core-map" in str(e.value) and "--confidence" in str(e.value)
    assert "at even odds (--confidence 0.5) the cheapest is" in str(e.value)
    assert not list(tmp_path.glob("*.yaml"))


def fake_run(root, name: str, points: list[tuple[int, float, float]], label: str = "CORE") -> None:
    """A run directory in the real formats: evals.jsonl's CORE records and TensorBoard's val/loss (logged at
    the index of the step's last batch, as Lightning logs it)."""
    run = root / name
    writer = SummaryWriter(str(run / rundir.TB))
    for step, loss, core in points:
        writer.add_scalar("val/loss", loss, step - 1)
        record = {"label": label, "version": "v1", "convention": "nanochat", "value": core, "stderr": 0.008}
        rundir.append_evals(run, {"step": step, "core": record})
    writer.close()


def test_core_map_calibrates_the_shift_on_run_directories_and_plans_read_it(tmp_path, capsys):
    truth = CoreMap(5.24, 1.186, 0.0198, 0.35, 0.0, 0.01, "v1", True, "truth")
    for name, losses in (("small", (3.9, 3.5)), ("mid", (3.4, 3.2)), ("large", (3.1, 3.0))):
        fake_run(tmp_path, name, [(100 * (i + 1), x, float(truth.mean(x))) for i, x in enumerate(losses)])
    out = tmp_path / "core_map.json"
    lm(["core-map", *(str(tmp_path / n) for n in ("small", "mid", "large")), "--out", str(out)])
    record = json.loads(out.read_text())
    fitted = core_map.read_map(out)
    assert fitted.calibrated and abs(fitted.shift - 0.35) < 0.05 and record["name"] == "CORE v1 nanochat"
    assert sum(p["signal"] for p in record["points"]) == fitted.points < len(record["points"])
    assert "wrote" in capsys.readouterr().out
    lm(["plan", "--usd", "30", "--gpu", "h100_sxm", "--corpus-tokens", "100000000000", "--core-map", str(out),
        "--out-dir", str(tmp_path / "plans")])  # fmt: skip
    assert f"calibrated on {fitted.points} points (3 runs: small, mid, large)" in capsys.readouterr().out


def test_core_map_refuses_runs_near_chance_or_scored_two_ways(tmp_path):
    fake_run(tmp_path, "tiny", [(100, 5.0, 0.01), (200, 4.6, 0.03)])
    with pytest.raises(Refused, match="no run reached CORE 0.1 clear of chance"):
        calibrate.core_map_record([tmp_path / "tiny"], "v1")
    fake_run(tmp_path, "a", [(100, 3.0, 0.2)])
    fake_run(tmp_path, "b", [(100, 3.0, 0.2)], label="CORE-18")
    with pytest.raises(Refused, match="differ"):
        calibrate.core_map_record([tmp_path / "a", tmp_path / "b"], "v1")
    with pytest.raises(Refused, match="evals=core"):
        calibrate.core_map_record([tmp_path / "missing"], "v1")
