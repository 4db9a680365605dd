"""The GPU catalog, the cost meter, phases and the run report, checked against independent arithmetic."""

import datetime
import itertools
import json
import math
import re

import pytest
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2, metadata
from tensorboard.util import tensor_util

from lm.base.exits import Refused
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.step import restore
from lm.checkpoint.run_state import RunState
from lm.config import CostConfig, GpuConfig, PhaseConfig
from lm.model import ModelConfig
from lm.numbers import cost
from lm.numbers.run_plan import phase_at
from lm.run.train import main
from lm.store.rundir import read_phases, write_ledger
from lm.store.tensorboard_layout import LOSS_BY_CENTS

from ..conftest import CONF

PRICE = 3600.0  # $1 a second: dollars read as seconds
PHASES = (
    "phases.phases=[{name:one,end_step:10},{name:two,end_step:20,goal_loss:9.0},{name:three,end_step:30}]"
)
RUN = [PHASES, f"cost.price_per_hour={PRICE}", "trainer.val_every_steps=10", "trainer.log_every_n_steps=1",
       "checkpoint.every_n_steps=10", "optim.total_steps=30", "optim.warmup_steps=5"]  # fmt: skip
TOKENS_PER_STEP = 8 * 64  # data.batch_size x data.seq_len in the TINY overrides


def series(run_dir, tag):
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.wall_time)}


def run_layout(run_dir) -> layout_pb2.Layout:
    """The Custom Scalars layout the run wrote into its event file."""
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={TENSORS: 0})
    events.Reload()
    (config,) = events.Tensors(metadata.CONFIG_SUMMARY_TAG)
    return layout_pb2.Layout.FromString(tensor_util.make_ndarray(config.tensor_proto).item())


def test_flops_per_token_follows_the_documented_formula():
    cfg = ModelConfig(vocab_size=32000, n_layer=18, d_model=2048, n_head=16, max_seq_len=2048)
    n = cost.non_embedding_params(cfg)
    assert n == 990_455_808
    assert cost.flops_per_token(cfg, 2048) == 6 * n + 12 * 18 * 2048 * 2048
    # 28,300 tokens/s on an A100 (the seed's figure) is ~60% MFU by this formula.
    a100 = cost.load_catalog(CONF)["a100_80gb"]
    util = cost.mfu(28_300, cost.flops_per_token(cfg, 2048), cost.peak_flops(a100, "bf16-mixed", True), 1)
    assert util == pytest.approx(28_300 * (6 * n + 12 * 18 * 2048 * 2048) / 312e12)
    assert 0.5 < util < 0.7


def test_the_catalog_has_every_gpu_with_dated_sourced_prices():
    catalog = cost.load_catalog(CONF)
    expected = {"cpu", "a100_80gb", "a100_40gb", "a40", "rtx_a6000", "l40s", "rtx_pro_6000", "h100_sxm",
                "h100_pcie", "h200", "b200"}  # fmt: skip
    assert set(catalog) == expected
    for name, gpu in catalog.items():
        assert gpu.name == name
        if name != "cpu":
            assert gpu.peak_bf16_tflops > gpu.peak_tf32_tflops > 0 and gpu.memory_gb and gpu.bandwidth_gbps
            assert gpu.price_on_demand > 0
        if gpu.price_on_demand or gpu.price_spot is not None:  # every priced entry: a date and a source
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", gpu.price_date), f"{name}: price_date not an ISO date"
            assert datetime.date.fromisoformat(gpu.price_date) <= datetime.date.today(), name
            # The source names a page to check, or says plainly that the figure is unverified.
            assert "https://" in gpu.price_source or "unverified" in gpu.price_source, name
        if gpu.price_spot is not None:
            assert 0 < gpu.price_spot < gpu.price_on_demand, f"{name}: spot must undercut on-demand"


def test_b200_is_catalogued_above_h100():
    catalog = cost.load_catalog(CONF)
    b200, h100 = catalog["b200"], catalog["h100_sxm"]
    for field in ("peak_bf16_tflops", "peak_tf32_tflops", "peak_fp8_tflops", "memory_gb", "bandwidth_gbps"):
        assert getattr(b200, field) > getattr(h100, field), field
    assert cost.fp8_peak_ratio(b200) == pytest.approx(2.0)  # FP8 tensor cores: twice the dense bf16 peak
    assert cost.detect("NVIDIA B200", catalog) is b200
    assert cost.detect("NVIDIA GB200", catalog) is None  # the Grace superchip's B200 runs at other clocks


@pytest.mark.parametrize(
    ("device_name", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", "h100_sxm"),
        ("NVIDIA H100 PCIe", "h100_pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100_80gb"),
        ("NVIDIA A100-PCIE-40GB", "a100_40gb"),
        ("NVIDIA A40", "a40"),
        ("NVIDIA RTX A6000", "rtx_a6000"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx_pro_6000"),
        ("NVIDIA RTX A4000", None),
        ("Tesla T4", None),
    ],
)
def test_gpu_auto_detection(device_name, entry):
    found = cost.detect(device_name, cost.load_catalog(CONF))
    assert (found.name if found else None) == entry


def test_peaks_and_prices():
    h100 = cost.load_catalog(CONF)["h100_sxm"]
    assert cost.peak_flops(h100, "bf16-mixed", True) == pytest.approx(989.4e12)
    assert cost.peak_flops(h100, "32-true", True) == pytest.approx(494.7e12)
    assert cost.peak_flops(h100, "32-true", False) is None  # no catalogued fp32 peak: no MFU, not a guess
    assert cost.price_per_hour(h100, CostConfig(pricing="spot")) == 1.49
    assert cost.price_per_hour(h100, CostConfig(price_per_hour=0.5)) == 0.5
    with pytest.raises(Refused, match="no spot price for gpu=a40"):
        cost.price_per_hour(cost.load_catalog(CONF)["a40"], CostConfig(pricing="spot"))
    assert cost.price_per_hour(GpuConfig(name="unknown"), CostConfig()) is None
    assert cost.usd(3600, 2.0, 8) == 16.0
    assert cost.usd_per_billion_tokens(28_300, 1.45, 1) == pytest.approx(14.23, abs=0.01)  # the seed's table


def test_phase_at_is_a_pure_lookup():
    phases = [
        PhaseConfig("a", end_step=200),
        PhaseConfig("b", end_tokens=1000),
        PhaseConfig("c", end_step=900),
    ]
    assert [phase_at(s, 0, phases) for s in (0, 199, 200)] == [0, 0, 1]
    assert phase_at(500, 999, phases) == 1 and phase_at(500, 1000, phases) == 2
    assert phase_at(900, 10**6, phases) == 3  # past the plan
    with pytest.raises(Refused, match="exactly one of end_step or end_tokens"):
        PhaseConfig("bad")


def check_rows(run_dir, rows):
    """Each phase row against independent arithmetic and the metrics TensorBoard recorded."""
    tokens_logged = series(run_dir, "train/tokens")
    val_logged = series(run_dir, "val/loss")
    for row in rows:
        assert row["steps"] == row["end_step"] - row["start_step"]
        assert row["tokens"] == row["steps"] * TOKENS_PER_STEP
        assert row["usd"] == pytest.approx(row["wall_hours"] * PRICE, rel=1e-9)
        assert row["loss_drop"] == pytest.approx(row["start_loss"] - row["end_loss"])
        if row["loss_drop"] > 0:
            assert row["usd_per_loss_point"] == pytest.approx(row["usd"] / row["loss_drop"])
        # Lightning stamps a point with the index of the last batch, i.e. step - 1.
        assert (
            tokens_logged[row["end_step"] - 1] - tokens_logged.get(row["start_step"] - 1, 0) == row["tokens"]
        )
        # The boundary evaluation uses the same validation batches as val/loss at that step.
        assert row["end_loss"] == pytest.approx(val_logged[row["end_step"] - 1], abs=1e-4)
    for before, after in itertools.pairwise(rows):
        assert after["start_loss"] == before["end_loss"] and after["start_step"] == before["end_step"]


@pytest.mark.slow  # 26-74 s on 2 cores: the README command stays under 10 min
def test_three_phases_priced_and_checked_against_the_logs(tiny_cfg, tmp_path):
    main(tiny_cfg(*RUN, "run.name=straight", "trainer.max_steps=30"))
    run = tmp_path / "runs/straight"
    rows = read_phases(run)
    assert [(r["name"], r["status"], r["start_step"], r["end_step"]) for r in rows] == [
        ("one", "done", 0, 10),
        ("two", "done", 10, 20),
        ("three", "done", 20, 30),
    ]
    check_rows(run, rows)
    assert rows[0]["start_loss"] == pytest.approx(math.log(512), abs=0.3)  # measured before any step
    assert rows[1]["goal_loss"] == 9.0 and rows[1]["goal_met"] is True
    ledger = json.loads((run / "cost.json").read_text())
    assert ledger["usd"] == pytest.approx(sum(ledger["seconds"].values()) * PRICE / 3600)
    assert ledger["usd"] > sum(r["usd"] for r in rows)  # start-up before phase one is paid for too
    assert series(run, "cost/usd")[29] <= ledger["usd"]
    assert set(series(run, "phase/index").values()) == {0.0, 1.0, 2.0, 3.0}
    # TensorBoard: the run wrote its layout (cost cards included) and the loss against cents spent.
    layout = run_layout(run)
    assert layout.category[0].title == "loss" and layout.category[-1].title == "cost"
    by_cents = series(run, LOSS_BY_CENTS)
    assert len(by_cents) == 3 and max(by_cents) <= round(ledger["usd"] * 100)

    # Killed in the middle of phase two (step 15, between checkpoints at 10 and 20), then the same command
    # again: the rows hold the same arithmetic, the same losses, and the restart is paid for.
    main(tiny_cfg(*RUN, "run.name=split", "trainer.max_steps=15"))
    main(tiny_cfg(*RUN, "run.name=split", "trainer.max_steps=30"))
    split = tmp_path / "runs/split"
    split_rows = read_phases(split)
    check_rows(split, split_rows)
    for a, b in zip(rows, split_rows, strict=True):
        assert (a["start_loss"], a["end_loss"], a["tokens"]) == (b["start_loss"], b["end_loss"], b["tokens"])
    ledger = json.loads((split / "cost.json").read_text())
    assert ledger["seconds"]["restart"] > 0


def test_report_is_written_at_the_end_and_by_the_cli(tiny_cfg, tmp_path, capsys):
    main(tiny_cfg(*RUN, "trainer.max_steps=15"))
    run = tmp_path / "runs/smoke"
    report = (run / "report.md").read_text()
    assert "| 1. one | 0-10 |" in report and "(partial)" in report  # phase two is under way
    assert "## Where the money went" in report and "6*N_non_embedding" in report
    for png in ("loss_vs_usd.png", "loss_vs_tokens.png", "throughput.png", "cost_breakdown.png"):
        assert (run / png).stat().st_size > 1000
    (run / "report.md").unlink()
    from lm.cli import main as cli

    cli(["report", str(run)])
    assert (run / "report.md").is_file()
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert {"phases/text_summary", "report/text_summary"} <= set(acc.Tags()["tensors"])


@pytest.mark.slow  # 26-74 s on 2 cores: the README command stays under 10 min
def test_an_unpriced_run_reports_hours_and_says_how_to_price_it(tiny_cfg, tmp_path):
    """A CPU run is priced at $0/h: its headline chart is loss against hours, not a column of points at $0."""
    main(tiny_cfg(PHASES, "trainer.val_every_steps=10", "trainer.max_steps=20"))
    run = tmp_path / "runs/smoke"
    report = (run / "report.md").read_text()
    assert (run / "loss_vs_hours.png").stat().st_size > 1000 and not (run / "loss_vs_usd.png").exists()
    assert "![loss against hours](loss_vs_hours.png)" in report
    assert "| dollars | unpriced: " in report and "cost.price_per_hour=" in report
    assert "$0.0000" not in report and "| train |" in report and "| unpriced |" in report
    hours = series(run, "cost/hours")
    assert list(hours.values()) == sorted(hours.values()) and hours[19] > 0
    # TensorBoard: no card of dollars that are all zero, and a layout that opens on the loss.
    logged = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    logged.Reload()
    assert not [t for t in logged.Tags()["scalars"] if t.startswith("cost/usd") or t == LOSS_BY_CENTS]
    layout = run_layout(run)
    assert layout.category[0].title == "loss" and "cost" not in [c.title for c in layout.category]


def test_phase_labels_never_overlap():
    from lm.run.report import phase_labels

    # Three phases ending within 4% of the x range share a label; one far away keeps its own.
    ends = [(0.0, "smoke test"), (0.01, "proof of life"), (0.03, "grind"), (1.0, "last push")]
    assert phase_labels(ends, 1.0) == [(0.03, "smoke test / proof of life / grind"), (1.0, "last push")]
    assert phase_labels([(0.0, "a"), (0.0, "b")], 0.0) == [(0.0, "a / b")]  # all at one x: one label
    assert phase_labels([(0.5, "b"), (0.0, "a")], 1.0) == [(0.0, "a"), (0.5, "b")]


@pytest.mark.slow  # 17-23 s on 2 cores: headroom under the README command's 10 min
def test_mfu_is_unavailable_on_cpu_unless_a_peak_is_configured(tiny_cfg, tmp_path):
    main(tiny_cfg("trainer.max_steps=4", "trainer.val_every_steps=4", "trainer.log_every_n_steps=2"))
    tags = EventAccumulator(str(tmp_path / "runs/smoke/tb")).Reload().Tags()["scalars"]
    assert "perf/tokens_per_sec" in tags and "perf/mfu" not in tags

    peak_tflops = 0.01
    cfg = tiny_cfg(
        "trainer.max_steps=4",
        "trainer.val_every_steps=4",
        "trainer.log_every_n_steps=2",
        "gpu=cpu",
        f"gpu.peak_tf32_tflops={peak_tflops}",
        "run.name=peak",
    )
    main(cfg)
    run = tmp_path / "runs/peak"
    fpt = cost.flops_per_token(ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True)), 64)
    tps, util = series(run, "perf/tokens_per_sec"), series(run, "perf/mfu")
    for step, value in util.items():
        assert value == pytest.approx(tps[step] * fpt / (peak_tflops * 1e12), rel=1e-6)

    # A sequence-length warm-up trains windows of 16 then 32 tokens over its 4 steps, then 64: each logged MFU
    # is counted with the windows its steps trained (less attention per token), not the full 64.
    main(
        tiny_cfg(
            "trainer.max_steps=6",
            "trainer.val_every_steps=6",
            "trainer.log_every_n_steps=2",
            "gpu=cpu",
            f"gpu.peak_tf32_tflops={peak_tflops}",
            "data.seq_len_warmup_steps=4",
            "run.name=warmup",
        )
    )
    run = tmp_path / "runs/warmup"
    tps, util = series(run, "perf/tokens_per_sec"), series(run, "perf/mfu")
    model = ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    windows = {1: 16, 3: 32, 5: 64}  # the logged step (0-based) -> the window of the two steps it closes
    assert sorted(util) == sorted(windows)
    for step, window in windows.items():
        expected = tps[step] * cost.flops_per_token(model, window) / (peak_tflops * 1e12)
        assert util[step] == pytest.approx(expected, rel=1e-6), step


def test_gpu_auto_resolution_and_an_unknown_gpu(caplog):
    assert cost.resolve_gpu(GpuConfig(name="auto"), None, CONF).gpu.name == "cpu"
    assert cost.resolve_gpu(GpuConfig(name="auto"), "NVIDIA H100 80GB HBM3", CONF).gpu.name == "h100_sxm"
    explicit = cost.load_catalog(CONF)["a40"]
    assert cost.resolve_gpu(explicit, "NVIDIA H100 80GB HBM3", CONF).gpu is explicit  # the user's choice wins
    unknown = cost.resolve_gpu(GpuConfig(name="auto"), "Tesla T4", CONF)
    assert unknown.gpu.name == "unknown" and unknown.device_name == "Tesla T4"
    assert "not in the catalog" in caplog.text and "conf/gpu/<name>.yaml" in caplog.text
    assert cost.peak_flops(unknown.gpu, "bf16-mixed", True) is None
    assert cost.price_per_hour(unknown.gpu, CostConfig()) is None


def meter_resumed_from(tmp_path, ckpt_seconds: dict, ckpt_step: int, ledger_seconds: dict, ledger_step: int):
    """A CostMeter restored from a checkpoint's state beside the ledger the previous process left."""
    write_ledger(tmp_path, {"seconds": ledger_seconds, "tokens": 0, "step": ledger_step})
    meter = CostMeter(
        tokens_per_device_step=1, flops_per_token=1.0, peak_flops=None, price_per_hour=3.6, log_every=1,
        run_dir=tmp_path, run_state=RunState(),
    )  # fmt: skip
    saved = {"seconds": ckpt_seconds, "tokens": 0, "step": ckpt_step, "restarts": 0}
    restore(meter, {"run_state": {"meter": saved}})  # as a resume does
    return meter.state.seconds


def test_the_final_saves_write_time_is_checkpoint_time_not_a_restart(tmp_path):
    """The checkpoint's copy of the meter is taken as the save begins, so the ledger (written after it) holds
    the write's seconds; a resume used to book them under `restart` although no work was lost."""
    before = {"startup": 1.0, "train": 50.0, "eval": 5.0, "checkpoint": 2.0, "restart": 0.0}
    after_save = {**before, "checkpoint": 9.0}  # the final save took 7 s, nothing trained since
    seconds = meter_resumed_from(tmp_path, before, 100, after_save, 100)
    assert seconds["checkpoint"] == pytest.approx(9.0)
    assert seconds["restart"] < 1.0  # only this process's own start-up (milliseconds here)


def test_work_done_after_the_checkpoint_is_paid_as_a_restart(tmp_path):
    before = {"startup": 1.0, "train": 50.0, "eval": 5.0, "checkpoint": 2.0, "restart": 0.0}
    crashed = {**before, "train": 80.0, "eval": 6.0}  # 31 s of work after the checkpoint, redone on resume
    seconds = meter_resumed_from(tmp_path, before, 100, crashed, 160)
    assert seconds["train"] == 50.0 and seconds["checkpoint"] == 2.0
    assert seconds["restart"] == pytest.approx(31.0, abs=1.0)
