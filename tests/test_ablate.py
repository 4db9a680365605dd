"""`lm ablate`: the intervals and verdicts it reports, its refusals, and a real ablation killed and continued."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lm.numbers.stats import difference, t_interval, t_quantile, verdict, welch_interval
from lm.tools.ablate import (
    BASELINE,
    Job,
    RunResult,
    Shape,
    Spec,
    fraction_steps,
    load_spec,
    plan_jobs,
    summarize,
    tokens_to_reach,
)

from .conftest import CONF, TINY

ROOT = CONF.parent
TIMEOUT_S = 600


# -- intervals ------------------------------------------------------------------------------------------


def test_t_quantiles_match_the_tables():
    # Values from any t table (two-sided 95%); fractional df (Welch) between them.
    for df, t in [(1, 12.706), (2, 4.303), (3, 3.182), (9, 2.262), (30, 2.042), (120, 1.980)]:
        assert t_quantile(df) == pytest.approx(t, abs=1e-3)
    assert t_quantile(4.5) == pytest.approx(2.659, abs=5e-3)
    assert t_quantile(50) == pytest.approx(2.009, abs=2e-3)
    assert t_quantile(1e6) == pytest.approx(1.960, abs=1e-3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0.5)


def test_t_interval_of_three_seeds():
    iv = t_interval([1.0, 2.0, 3.0])  # mean 2, sd 1, t(2) = 4.303
    assert (iv.mean, iv.n) == (2.0, 3)
    assert iv.half == pytest.approx(4.303 / math.sqrt(3), abs=1e-3)
    assert t_interval([]) is None
    one = t_interval([2.5])
    assert (one.low, one.high, one.n) == (2.5, 2.5, 1)


def test_pairing_removes_the_spread_the_seeds_share():
    # Seeds differ a lot from each other; the variant is better by 0.01 on every one of them.
    base = {0: 3.00, 1: 3.20, 2: 2.90}
    variant = {s: v - 0.01 + 0.001 * s for s, v in base.items()}
    paired, how = difference(variant, base)
    assert how == "paired" and paired.high < 0 and verdict(paired) == "wins"
    unpaired = welch_interval(list(variant.values()), list(base.values()))
    assert unpaired.low < 0 < unpaired.high and verdict(unpaired) == "within noise"
    worse = {s: v + 0.02 for s, v in base.items()}
    assert verdict(difference(worse, base)[0]) == "loses"
    assert verdict(difference({0: 1.0}, {0: 1.1})[0]) == "too few seeds"


def test_tokens_to_reach_interpolates_and_says_when_it_cannot():
    points = [(100.0, 4.0), (200.0, 3.0), (300.0, 2.5)]
    assert tokens_to_reach(points, 3.5) == (150.0, False)
    assert tokens_to_reach(points, 2.5) == (300.0, False)
    assert tokens_to_reach(points, 2.4) == (None, False)
    assert tokens_to_reach(points, 4.5) == (100.0, True)  # the shortest run is already below: at most that


# -- the summary on known numbers -----------------------------------------------------------------------


def result(arm: str, seed: int, final: float, fraction: float = 1.0, steps: int = 100) -> RunResult:
    """A finished run whose validation curve falls linearly to `final` over `steps` steps of 10 tokens."""
    at = [steps // 4, steps // 2, 3 * steps // 4, steps]
    losses = [final + 0.3, final + 0.2, final + 0.1, final]
    return RunResult(
        f"{arm}-s{seed}", arm, seed, fraction, "done", at, [10.0 * s for s in at], losses, final, 0.1
    )


def test_summary_of_a_lever_that_wins_and_one_within_noise():
    spec = Spec(
        name="t",
        variants={"good": ["model.qk_norm=true"], "same": ["model.z_loss=1e-4"]},
        seeds=[0, 1, 2],
        fractions={"good": [0.5]},
    )
    shape = Shape(steps=100, val_every=25, tokens_per_step=10, flops_per_token=1e6, vocab_size=512)
    shapes = {BASELINE: shape, "good": shape, "same": shape}
    base = {0: 3.0, 1: 3.1, 2: 2.95}
    results = [result(BASELINE, s, v) for s, v in base.items()]
    results += [result("good", s, v - 0.05) for s, v in base.items()]
    # The good lever's half-length runs land exactly on the baseline's mean final loss: 0.5x the tokens.
    mean = sum(base.values()) / 3
    results += [result("good", s, mean, fraction=0.5, steps=50) for s in base]
    results += [result("same", s, v + (0.01 if s else -0.01)) for s, v in base.items()]
    rows = {r.arm: r for r in summarize(spec, results, shapes)}
    assert rows["good"].verdict == "wins" and rows["good"].delta.mean == pytest.approx(-0.05)
    assert rows["good"].tokens_ratio.mean == pytest.approx(0.5)
    assert rows["good"].usd_to_target_ratio.mean == pytest.approx(0.5)  # same FLOPs per token
    assert "shorter runs" in rows["good"].tokens_method
    assert rows["same"].verdict == "within noise"
    assert "upper bound" in rows["same"].tokens_method
    assert rows[BASELINE].final.mean == pytest.approx(mean)
    assert rows["good"].flops_ratio == 1.0
    # Modelled dollars per loss point: same tokens and FLOPs, a larger drop from ln(512) -> cheaper.
    assert rows["good"].usd_per_point_ratio < 1.0
    assert rows["good"].fractions["0.5"].mean == pytest.approx(mean)


def test_jobs_are_seed_major_and_fractions_round_to_validations(tmp_path):
    spec = Spec(name="t", variants={"v": []}, seeds=[0, 1], fractions={"v": [0.6]})
    shape = Shape(steps=300, val_every=30, tokens_per_step=1, flops_per_token=1.0, vocab_size=2)
    assert fraction_steps(shape, 0.6) == 180 and fraction_steps(shape, 0.01) == 30
    jobs = plan_jobs(spec, tmp_path, {BASELINE: shape, "v": shape})
    assert [j.name for j in jobs] == ["baseline-s0", "v-s0", "v-f0.6-s0", "baseline-s1", "v-s1", "v-f0.6-s1"]
    short: Job = jobs[2]
    assert "trainer.max_steps=180" in short.overrides and "optim.total_steps=180" in short.overrides
    assert "run.seed=0" in short.overrides and short.run_dir == tmp_path / "runs" / "v-f0.6-s0"


# -- refusals -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("variants: {}", "variants"),
        ("variants: {a: [x=1]}\nlr: 3", "unknown key"),
        ("variants: {baseline: [x=1]}", "baseline's name"),
        ("variants: {'a/b': [x=1]}", "letters, digits"),
        ("variants: {a: [x=1]}\nfractions: {b: [0.5]}", "names no variant"),
        ("variants: {a: [x=1]}\nfractions: {a: [1.5]}", "strictly between"),
        ("variants: {a: [x=1]}\nseeds: 0", "seeds"),
        ("variants: {a: [x=1]}\nvariants2: 1", "unknown key"),
    ],
)
def test_bad_specs_are_refused_with_the_key(tmp_path, text, message):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_spec(path)


def lm_ablate(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lm.cli", "ablate", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_a_bad_override_is_refused_before_anything_runs(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: [trainer=cpu]\nvariants:\n  typo: [model.qk_nrom=true]\n")
    out = tmp_path / "out"
    proc = lm_ablate(str(spec), "--out", str(out))
    assert proc.returncode == 78, proc.stderr
    assert "typo" in proc.stderr and "qk_nrom" in proc.stderr
    assert not out.exists()  # nothing ran, nothing was written
    missing = lm_ablate(str(tmp_path / "nope.yaml"))
    assert missing.returncode == 78 and "no ablation spec" in missing.stderr


# -- a real ablation, killed and continued ----------------------------------------------------------------


def spec_file(tmp_path: Path, cache: Path, variants: str) -> Path:
    base = [
        *TINY, "data.num_workers=0", "sampling=off", f"data.cache_dir={cache}", "trainer.max_steps=12",
        "trainer.val_every_steps=4", "trainer.limit_val_batches=2", "optim.warmup_steps=2",
        "checkpoint.every_n_steps=4",
    ]  # fmt: skip
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps({"name": "t", "base": base, "seeds": 2, "variants": json.loads(variants)}))
    return path


@pytest.mark.slow
def test_a_killed_ablation_continues_and_keeps_finished_runs(tmp_path, data_cache):
    spec = spec_file(tmp_path, data_cache, '{"qk_norm": ["model.qk_norm=true"]}')
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lm.cli", "ablate", str(spec), "--out", str(out), "--threads", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = out / "runs" / "baseline-s0" / "cost.json"
        deadline = time.monotonic() + TIMEOUT_S
        while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the first run is training: it saves and the ablation exits 75
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    assert "rerun the same command" in err
    assert not (out / "runs" / "qk_norm-s1").exists()  # nothing started after the stop

    again = lm_ablate(str(spec), "--out", str(out), "--threads", "1", "--parallel", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    table = (out / "ablation.md").read_text()
    assert "| qk_norm |" in table and "4/4 runs done" in table
    record = json.loads((out / "ablation.json").read_text())
    assert all(r["final"] is not None for r in record["runs"])
    rows = {r["arm"]: r for r in record["rows"]}
    assert rows["qk_norm"]["verdict"] in ("wins", "loses", "within noise")
    assert (out / "ablation.png").stat().st_size > 0
    assert (out / "ablation.csv").read_text().startswith("variant,")

    # A variant added later: the baseline's runs are reused, only the new variant's run.
    events = sorted(p.name for p in (out / "runs" / "baseline-s0" / "tb").iterdir())
    spec = spec_file(tmp_path, data_cache, '{"qk_norm": ["model.qk_norm=true"], "z": ["model.z_loss=1e-4"]}')
    third = lm_ablate(str(spec), "--out", str(out), "--threads", "1", "--parallel", "2")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "6 runs, 2 to run (4 done)" in third.stderr
    assert sorted(p.name for p in (out / "runs" / "baseline-s0" / "tb").iterdir()) == events
    assert "| z |" in (out / "ablation.md").read_text()


def test_muon_flops_are_newton_schulz_per_block_matrix():
    from lm.config import OptimConfig
    from lm.engine.optim import muon_flops_per_step
    from lm.model import ModelConfig

    cfg = ModelConfig(vocab_size=512, max_seq_len=64, n_layer=2, d_model=64, n_head=4)
    assert muon_flops_per_step(cfg, OptimConfig(name="adamw")) == 0.0
    hidden = cfg.hidden_dim  # SwiGLU's width: three 64 x hidden matrices, four 64 x 64 in attention

    def ns(m: int, n: int) -> float:
        return 5 * (4.0 * m * m * n + 2.0 * m**3)

    per_block = 4 * ns(64, 64) + 3 * ns(64, hidden)
    assert muon_flops_per_step(cfg, OptimConfig(name="muon")) == pytest.approx(2 * per_block)
