"""lm bench on the tiny model: sweeps expand, each combination is measured in its own process, an
out-of-memory combination is reported as "does not fit" and never recommended."""

import json
from pathlib import Path

import pytest
import torch

from lm.base.exits import Refused
from lm.config import conf_dir
from lm.numbers.cost import load_catalog
from lm.tools.bench import (
    Result,
    compare,
    expand,
    is_oom,
    markdown,
    rank,
    recommendation,
    run_bench,
    run_compare,
    run_one,
)

GPU_BENCHES = Path(__file__).parents[2] / "experiments/2026-11-23-gpu"

TINY_BENCH = [
    "trainer=cpu",
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=4",
    "data.vocab_size=512",
    "data.seq_len=64",
    "bench.warmup_steps=1",
    "bench.steps=3",
]


def test_sweeps_expand_like_hydra_multirun():
    fixed, combos = expand(["kernels=eager,compile", "data.batch_size=8", "activation_checkpointing=off,on"])
    assert fixed == ["data.batch_size=8"]
    assert combos == [
        ["kernels=eager", "activation_checkpointing=off"],
        ["kernels=eager", "activation_checkpointing=on"],
        ["kernels=compile", "activation_checkpointing=off"],
        ["kernels=compile", "activation_checkpointing=on"],
    ]
    assert expand(["data.batch_size=8"]) == (["data.batch_size=8"], [[]])


@pytest.mark.slow  # over ~15 s on 2 cores: CI's second pass
def test_bench_tiny_marks_out_of_memory_and_recommends_what_fits(tmp_path, capsys):
    """A real memory cap (the process's address space may grow by 0.15 GB): 512 x 64 tokens of a 512-wide
    vocabulary cannot fit, 4 x 64 can."""
    out = tmp_path / "bench"
    code = run_bench(
        [*TINY_BENCH, "data.batch_size=512,4", "bench.memory_limit_gb=0.15", f"bench.out_dir={out}"]
    )
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    rows = {" ".join(r["combo"]): r for r in report["results"]}
    small, big = rows["data.batch_size=4"], rows["data.batch_size=512"]
    assert big["status"] == "does not fit" and "memory" in big["error"].lower()
    assert small["status"] == "ok" and small["tokens_per_sec"] > 0 and small["step_seconds"] > 0
    assert small["peak_mem_kind"] == "cpu peak RSS" and small["peak_mem_gb"] > 0
    assert small["estimate_gb"] < big["estimate_gb"]
    assert report["recommended"] == ["data.batch_size=4"]
    assert [r["status"] for r in report["results"]] == ["ok", "does not fit"]  # ranked: what fits first
    md = (out / "bench.md").read_text()
    assert "does not fit" in md and "recommended (cheapest that fits): data.batch_size=4" in md
    assert "recommended" in capsys.readouterr().out

    # A bench of another model (the 1b on an H100) is not compared with this one.
    with pytest.raises(Refused, match="different models"):
        compare([out, GPU_BENCHES / "bench-compile"], "on_demand")


def test_a_failing_combination_is_an_error_row_with_its_message():
    r = run_one([*TINY_BENCH, "data.batch_size=2", "kernels=compile", "kernels.compile_mode=bogus"], [], 300)
    assert r.status == "error" and "bogus" in r.error and r.tokens_per_sec is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_liger_without_cuda_is_an_error_row_naming_the_fix():
    r = run_one([*TINY_BENCH, "data.batch_size=2", "kernels=liger"], [], 300)
    assert r.status == "error" and "kernels=eager" in r.error and r.tokens_per_sec is None


def test_auto_checkpointing_row_says_what_it_resolved_to():
    r = run_one([*TINY_BENCH, "data.batch_size=2", "activation_checkpointing=auto"], [], 300)
    assert r.status == "ok" and r.ac_every == 0 and r.note == "auto: off"  # no trial steps on a CPU
    table = markdown([r, Result(["x=1"], status="error", error="boom")], "on_demand", "# t")
    assert "| auto: off |" in table and "| boom |" in table


def test_bad_combination_is_refused_before_any_run(tmp_path):
    with pytest.raises(Refused, match="n_head"):
        run_bench([*TINY_BENCH, "model.n_head=3,4", f"bench.out_dir={tmp_path}"])
    with pytest.raises(Refused, match="CUDA"):
        run_bench([*TINY_BENCH, "precision=fp32,fp16", f"bench.out_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())


def test_rank_and_recommendation():
    fast = Result(["a=1"], status="ok", tokens_per_sec=200.0, usd_per_btok={"on_demand": 1.0})
    slow = Result(["a=2"], status="ok", tokens_per_sec=100.0, usd_per_btok={"on_demand": 2.0})
    oom = Result(["a=3"], status="does not fit")
    broken = Result(["a=4"], status="error", error="boom")
    ranked = rank([broken, oom, slow, fast], "on_demand")
    assert [r.combo for r in ranked] == [["a=1"], ["a=2"], ["a=3"], ["a=4"]]
    assert recommendation(ranked).endswith("a=1")
    assert "no combination fits" in recommendation([oom, broken])


def test_out_of_memory_is_recognised():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1"))
    assert not is_oom(ValueError("model.d_model=65 is not divisible"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_gpu_caps_memory(tmp_path):
    """On a GPU: a 1 GB cap (set_per_process_memory_fraction) makes the big micro-batch a CUDA OOM."""
    out = tmp_path / "bench"
    args = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "data.vocab_size=8192"]
    run_bench(
        [
            *args,
            "data.seq_len=512",
            "data.batch_size=2,256",
            "bench.memory_limit_gb=1",
            f"bench.out_dir={out}",
        ]
    )
    rows = {" ".join(r["combo"]): r for r in json.loads((out / "bench.json").read_text())["results"]}
    assert rows["data.batch_size=256"]["status"] == "does not fit"
    ok = rows["data.batch_size=2"]
    assert ok["status"] == "ok" and ok["peak_mem_kind"] == "cuda max allocated" and ok["mfu"] is not None


def test_compare_ranks_gpus_by_dollars_per_token_at_todays_catalog_prices(tmp_path, capsys):
    """The real H100 and H200 benches of the 1b model (experiments/2026-11-23-gpu) in one ranking."""
    catalog = load_catalog(conf_dir())
    benches = [
        GPU_BENCHES / "bench-eager",
        GPU_BENCHES / "bench-compile/bench.json",
        GPU_BENCHES / "bench-auto",
    ]
    rows, text = compare(benches, "on_demand", catalog)
    assert len(rows) == 10 and {row["result"].gpu for row in rows} == {"h100_sxm", "h200"}
    first = rows[0]["result"]
    assert (first.gpu, first.combo) == ("h100_sxm", ["kernels=compile", "activation_checkpointing=off"])
    prices = [row["result"].usd_per_btok["on_demand"] for row in rows]
    assert prices == sorted(prices)
    for row in rows:  # $/Btok from the measured tokens/s at the catalog's price, not the recorded one
        r = row["result"]
        assert r.usd_per_btok["on_demand"] == pytest.approx(
            catalog[r.gpu].price_on_demand / 3600 / r.tokens_per_sec * 1e9, rel=1e-3
        )
    # The H200 bench fixed overrides the others did not: its rows say so.
    h200 = [row["label"] for row in rows if row["result"].gpu == "h200"]
    assert sorted(h200) == [
        "activation_checkpointing=auto kernels=compile data.batch_size=16",
        "activation_checkpointing=auto kernels=compile data.batch_size=8",
    ]
    assert (
        "cheapest that fits at on_demand prices: gpu=h100_sxm kernels=compile activation_checkpointing=off"
        in text
    )
    assert "not a same-run ratio" in text

    # Spot: the H200 has no spot price in the catalog, so its rows rank after every priced row.
    rows, text = compare(benches, "spot", catalog)
    assert [row["result"].gpu for row in rows] == ["h100_sxm"] * 8 + ["h200"] * 2
    assert "spot" not in rows[-1]["result"].usd_per_btok

    assert run_compare([str(b) for b in benches], "on_demand", str(tmp_path / "cmp.md")) == 0
    written = json.loads((tmp_path / "cmp.json").read_text())
    assert written["pricing"] == "on_demand" and len(written["rows"]) == 10
    assert (tmp_path / "cmp.md").read_text() in capsys.readouterr().out


def test_compare_refuses_what_is_not_a_bench(tmp_path):
    with pytest.raises(Refused, match="no bench.json there"):
        compare([tmp_path], "on_demand")
    with pytest.raises(Refused, match="looks like a Hydra override"):
        compare([GPU_BENCHES / "bench-auto", Path("kernels=eager")], "on_demand")
    (tmp_path / "bench.json").write_text("{half a file")
    with pytest.raises(Refused, match="not a bench.json"):
        compare([tmp_path], "on_demand")
    (tmp_path / "bench.json").write_text(json.dumps({"results": "no"}))
    with pytest.raises(Refused, match="no `results` list"):
        compare([tmp_path / "bench.json"], "on_demand")
