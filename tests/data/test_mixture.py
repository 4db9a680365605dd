"""Weighted data mixtures (lm.data.mixture): proportions, exact resume, caps, refusals, per-source validation."""

import re
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lm.base.exits import EXIT_CONFIG, Refused, exit_code
from lm.cli import main as lm
from lm.config import DataConfig, MixtureSource, PhaseConfig, compose, to_objects
from lm.data import load_manifest, prepare
from lm.data.allocation import Allocation, Interleave
from lm.data.mixture import MixtureDataModule, MixtureSampler, mixed_val_batches, shared_tokenizer
from lm.data.stdlib import stdlib_documents
from lm.data.tokenizer import file_sha256, train_tokenizer
from lm.run.doctor import check_mixture, resolve_target
from lm.store.rundir import read_phases

from ..conftest import TINY, train_in_process
from .test_data import BatchRecorder

VOCAB = 300
SEQ = 32


def sources(weights=(0.5, 0.3, 0.2), caps=(None, None, None), sizes=(1000, 500, 200)):
    names = ["web", "code", "math"]
    specs = [MixtureSource(n, w, dir="unused", max_epochs=c) for n, w, c in zip(names, weights, caps)]
    return specs, list(sizes)


def drawn(sampler: MixtureSampler, steps: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(steps * sampler.accumulate)]


def source_counts(allocation: Allocation, first: int, n: int) -> np.ndarray:
    source, _ = allocation.segments[0].interleave.locate(first, n)
    return np.bincount(source, minlength=len(allocation.names))


# --- allocation and sampler, no data -------------------------------------------------------------------------


def test_proportions_hold_within_a_few_windows_over_any_stretch_of_steps():
    specs, sizes = sources()
    allocation = Allocation(specs, sizes, per_step=16)
    rng = np.random.default_rng(0)
    for first, n in [
        (0, 160),
        (12_345, 1600),
        *((int(rng.integers(1e6)), int(rng.integers(16, 5000))) for _ in range(20)),
    ]:
        counts = source_counts(allocation, first, n)
        assert counts.sum() == n
        assert np.abs(counts - n * np.array([0.5, 0.3, 0.2])).max() <= 2  # K sources: within ~K/2+1 samples


def test_every_sample_is_its_sources_next_one_so_no_window_repeats_within_an_epoch():
    alloc = Interleave([3, 2, 1, 0.5])
    source, index = alloc.locate(0, 20_000)
    for k in range(4):
        assert index[source == k].tolist() == list(range((source == k).sum()))  # 0, 1, 2, ... in order
    assert alloc.counts(20_000).tolist() == np.bincount(source, minlength=4).tolist()
    assert alloc.counts(777).tolist() == np.bincount(source[:777], minlength=4).tolist()


def test_the_sampler_resumes_exactly_and_ranks_split_one_process_s_batches():
    specs, sizes = sources()
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    allocation = Allocation(specs, sizes, per_step=2 * 8)
    full = drawn(MixtureSampler(allocation, offsets, 8, seed=3, accumulate=2), 40)
    resumed = drawn(MixtureSampler(allocation, offsets, 8, seed=3, accumulate=2, start_step=17), 23)
    assert resumed == full[34:]
    # Two ranks of batch 4 draw exactly what one process of batch 8 draws, step by step.
    ranks = [
        drawn(MixtureSampler(allocation, offsets, 4, seed=3, accumulate=2, world_size=2, rank=r), 40)
        for r in (0, 1)
    ]
    assert [a + b for a, b in zip(*ranks)] == full
    windows = np.array(full).ravel()
    share = np.bincount(np.searchsorted(offsets, windows, side="right") - 1, minlength=3) / windows.size
    assert np.allclose(share, [0.5, 0.3, 0.2], atol=0.01)
    for k in range(3):  # each source goes through all its windows before it repeats one
        mine = windows[(windows >= offsets[k]) & (windows < offsets[k + 1])]
        assert len(set(mine[: sizes[k]].tolist())) == min(len(mine), sizes[k])


def test_a_cap_stops_the_plan_or_renormalises_the_other_weights():
    specs, sizes = sources(caps=(None, None, 2.0))  # math: 200 windows x 2 epochs = 400 samples at 20%
    stop = Allocation(specs, sizes, per_step=16, on_exhausted="stop")
    assert stop.stop_step == 125  # 125 steps x 16 x 0.2 = 400: step 125 would take math past its cap
    assert stop.counts_at(125)[2] <= 400 < stop.segments[0].counts_after(126, 16)[2]
    renorm = Allocation(specs, sizes, per_step=16, on_exhausted="renormalise")
    assert renorm.stop_step is None and renorm.exhausted == {"math": 125}
    assert renorm.counts_at(10_000)[2] == renorm.counts_at(125)[2] <= 400
    later = renorm.counts_at(10_125) - renorm.counts_at(125)
    assert np.allclose(later / later.sum(), [0.5 / 0.8, 0.3 / 0.8, 0], atol=0.001)


def test_phase_weights_take_over_at_the_phase_boundary_and_counts_continue():
    specs, sizes = sources()
    phases = [
        PhaseConfig("main", end_step=100),
        PhaseConfig("anneal", end_step=200, mixture={"web": 0, "math": 0.7}),
    ]
    allocation = Allocation(specs, sizes, per_step=10, phases=phases)
    assert [s.start for s in allocation.segments] == [0, 100]
    first, second = allocation.counts_at(100), allocation.counts_at(200) - allocation.counts_at(100)
    assert np.allclose(first / 1000, [0.5, 0.3, 0.2], atol=0.003)
    assert np.allclose(second / 1000, [0, 0.3, 0.7], atol=0.003)
    # The second phase continues each source's count: no window is drawn twice at the boundary.
    source, index = allocation.locate(1000, 10)
    assert (index[source == 1] >= first[1]).all()
    across, parts = allocation.locate(995, 10), [allocation.locate(995, 5), allocation.locate(1000, 5)]
    assert all((a == np.concatenate(b)).all() for a, b in zip(across, zip(*parts)))


def test_validation_batches_are_one_source_each_in_weighted_turns():
    batches, which = mixed_val_batches([40, 16, 8], [0.5, 0.3, 0.2], batch_size=4)
    assert len(batches) == 16 and sorted(which) == [0] * 10 + [1] * 4 + [2] * 2
    offsets = [0, 40, 56, 64]
    assert all(offsets[k] <= i < offsets[k + 1] for b, k in zip(batches, which) for i in b)
    assert sorted(i for b in batches for i in b) == list(range(64))
    assert which[:5].count(0) in (2, 3)  # turns follow the weights from the first batch


def test_bad_mixture_configs_are_refused_naming_the_fix():
    with pytest.raises(Refused, match="exactly one of dir"):
        MixtureSource("web", 1.0)
    with pytest.raises(Refused, match="distinct source names"):
        DataConfig(mixture=[MixtureSource("a", dir="x"), MixtureSource("a", dir="y")])
    with pytest.raises(Refused, match="on_exhausted"):
        DataConfig(on_exhausted="wrap")
    with pytest.raises(Refused, match="val/loss/<name>"):
        MixtureSource("web text", dir="x")
    with pytest.raises(Refused, match="must be >= 0"):
        PhaseConfig("anneal", end_step=10, mixture={"web": -1})
    with pytest.raises(
        Refused, match=r"phase 'anneal' sets mixture weights of \['wbe'\].*its sources: \['code', 'web'\]"
    ):
        to_objects(compose(["data=mixture", "phases.phases=[{name:anneal,end_step:10,mixture:{wbe:1}}]"]))


# --- real prepared sources ------------------------------------------------------------------------------------


def write_documents(folder: Path, texts: list[str]) -> str:
    folder.mkdir(parents=True)
    for i, text in enumerate(texts):
        (folder / f"{i}.txt").write_text(text)
    return str(folder / "*.txt")


def prepare_source(root: Path, name: str, texts: list[str], tokenizer: Path) -> Path:
    paths = write_documents(root / "text" / name, texts)
    cfg = DataConfig(
        source="text", paths=paths, tokenizer=str(tokenizer), vocab_size=VOCAB, seq_len=SEQ, val_fraction=0.2,
        cache_dir=str(root / "cache"), dir=str(root / "tokens" / name), num_proc=1, num_workers=0,
    )  # fmt: skip
    return prepare(cfg)


@pytest.fixture(scope="session")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """Three small prepared sources (stdlib source cut into 40-line documents) sharing one tokenizer, one made
    by another tokenizer, and one too small for a window."""
    root = tmp_path_factory.mktemp("mixture")
    pieces = []
    for doc in stdlib_documents(max_bytes=400_000).documents:
        lines = doc.text.splitlines(keepends=True)
        pieces += ["".join(lines[i : i + 40]) for i in range(0, len(lines), 40)]
    tokenizer = root / "tokenizer.json"
    train_tokenizer(pieces, VOCAB).save(str(tokenizer))
    other = root / "other-tokenizer.json"
    train_tokenizer(pieces[::7], VOCAB).save(str(other))
    folders = {
        name: prepare_source(root, name, pieces[i::3], tokenizer)
        for i, name in enumerate(["web", "code", "math"])
    }
    folders["alien"] = prepare_source(root, "alien", pieces[1::5], other)
    folders["tiny"] = prepare_source(root, "tiny", ["hello world\n", "bye\n"], tokenizer)
    return folders


def mixture_cfg(
    corpora: dict[str, Path], names=("web", "code", "math"), weights=(0.5, 0.3, 0.2), **kw
) -> DataConfig:
    specs = [MixtureSource(n, w, dir=str(corpora[n])) for n, w in zip(names, weights)]
    base = dict(vocab_size=VOCAB, seq_len=SEQ, batch_size=4, num_workers=0, source="tokens", mixture=specs)
    return DataConfig(**{**base, **kw})


def test_a_source_of_another_tokenizer_is_refused_naming_both(corpora):
    dm = MixtureDataModule(mixture_cfg(corpora, names=("web", "alien"), weights=(1, 1)))
    with pytest.raises(
        Refused,
        match=r"'web' and 'alien' were tokenized differently.*sha256 [0-9a-f]{64}.*sha256 [0-9a-f]{64}",
    ):
        dm.check_prepared()


def test_a_run_on_sources_of_two_tokenizers_exits_78_before_its_run_directory_exists(corpora, tmp_path):
    overrides = mixture_overrides(corpora, tmp_path, "run.name=alien", "trainer.max_steps=2")
    overrides = [o.replace(f"'{corpora['math']}'", f"'{corpora['alien']}'") for o in overrides]
    with pytest.raises(Refused, match="'web' and 'math' were tokenized differently") as refusal:
        train_in_process(overrides)
    assert exit_code(refusal.value) == EXIT_CONFIG
    assert not (tmp_path / "runs/alien/checkpoints").exists()


def test_an_empty_source_is_refused_naming_it(corpora):
    dm = MixtureDataModule(mixture_cfg(corpora, names=("web", "tiny"), weights=(1, 1)))
    with pytest.raises(Refused, match="source 'tiny' .* has \\d+ train tokens, fewer than one window"):
        dm.check_prepared()


def fit(
    cfg: DataConfig, max_steps: int, ckpt: Path | None = None, resume: Path | None = None
) -> BatchRecorder:
    """test_data's resume method over a mixture: a recorder model fit for max_steps, optionally resumed."""
    dm = MixtureDataModule(cfg)
    model = BatchRecorder(VOCAB)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=-1, max_steps=max_steps, accumulate_grad_batches=2, limit_val_batches=0,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=resume)
    if ckpt:
        trainer.save_checkpoint(ckpt)
    return model


def test_a_resumed_lightning_run_sees_the_same_mixed_batches(corpora, tmp_path):
    cfg = mixture_cfg(corpora)
    full = fit(cfg, max_steps=6).seen
    fit(cfg, max_steps=3, ckpt=tmp_path / "step3.ckpt")
    resumed = fit(cfg, max_steps=6, resume=tmp_path / "step3.ckpt").seen
    assert len(full) == 12 and len(resumed) == 6  # 2 micro-batches per optimizer step
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[6:]))


@pytest.mark.parametrize("on_exhausted", ["stop", "renormalise"])
def test_a_capped_source_stops_or_renormalises_the_lightning_run_at_its_cap(corpora, on_exhausted):
    cfg = mixture_cfg(corpora, on_exhausted=on_exhausted)
    dm = MixtureDataModule(cfg)
    dm.setup()
    cap = 12  # math samples: at 20% of 8 samples a step, the cap is met after 7 steps
    cfg.mixture[2].max_epochs = cap / len(dm.train_set.parts[2])
    model = fit(cfg, max_steps=10)
    allocation = model.trainer.datamodule.allocation
    if on_exhausted == "stop":
        assert allocation.stop_step == 7 and len(model.seen) == 2 * 7  # the run ended at the cap, not at 10
    else:
        assert allocation.exhausted == {"math": 7} and len(model.seen) == 2 * 10
    assert allocation.counts_at(len(model.seen) // 2)[2] <= cap


def mixture_overrides(
    corpora: dict[str, Path], tmp_path: Path, *extra: str, math_epochs: str = "null"
) -> list[str]:
    sources = ",".join(
        f"{{name:{n},dir:'{corpora[n]}',weight:{w},max_epochs:{e}}}"
        for n, w, e in [("web", 0.5, "null"), ("code", 0.3, "null"), ("math", 0.2, math_epochs)]
    )
    return [
        *TINY, f"run.root={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}", "data=mixture",
        f"data.mixture=[{sources}]", f"data.vocab_size={VOCAB}", f"data.seq_len={SEQ}", "data.batch_size=4",
        "data.num_workers=0", "trainer.val_every_steps=4", "trainer.limit_val_batches=6",
        "checkpoint.every_n_steps=4", "+trainer.extra.num_sanity_val_steps=0", "sampling.prompts=[]",
        "phases.phases=[{name:main,end_step:4},{name:anneal,end_step:8,mixture:{web:0.1,math:0.6}}]", *extra,
    ]  # fmt: skip


def scalars(run: Path, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_a_mixture_run_logs_each_source_and_resumes_exactly_across_a_phase_weight_change(corpora, tmp_path):
    assert train_in_process(mixture_overrides(corpora, tmp_path, "run.name=mix", "trainer.max_steps=8")) == 0
    run = tmp_path / "runs/mix"
    mixed = scalars(run, "val/loss")
    per_source = {n: scalars(run, f"val/loss/{n}") for n in ("web", "code", "math")}
    assert len(mixed) == 2 and all(v.keys() == mixed.keys() for v in per_source.values())
    # 6 validation batches in turns of 0.5/0.3/0.2: 3 web, 2 code, 1 math, so val/loss is their weighted mean.
    last = max(mixed)
    expected = (3 * per_source["web"][last] + 2 * per_source["code"][last] + per_source["math"][last]) / 6
    assert mixed[last] == pytest.approx(expected, rel=1e-5)
    rows = read_phases(run)  # the phase table and the report give each source's loss too
    assert [r["name"] for r in rows] == ["main", "anneal"] and all("web=" in r["source_losses"] for r in rows)
    assert (
        f"validation loss, math | {per_source['math'][min(mixed)]:.3f} ->" in (run / "report.md").read_text()
    )
    # Stopped at step 4 (the phase boundary) and resumed into the re-weighted phase: the same weights.
    for steps in (4, 8):
        assert (
            train_in_process(
                mixture_overrides(corpora, tmp_path, "run.name=split", f"trainer.max_steps={steps}")
            )
            == 0
        )
    resumed = weights(tmp_path / "runs/split")
    assert all(torch.equal(resumed[k], v) for k, v in weights(run).items())


def test_the_doctor_tells_each_sources_share_epochs_and_where_a_cap_is_met(corpora, tmp_path):
    overrides = mixture_overrides(
        corpora, tmp_path, "trainer.max_steps=2000", "phases.phases=[]", math_epochs="0.5"
    )
    target = resolve_target(to_objects(compose(overrides)))
    found = {f.what.split(":")[0]: f for f in check_mixture(target)}
    cap = (load_manifest(corpora["math"])["splits"]["train"]["tokens"] - 1) // SEQ // 2
    assert found["math"].level == "warn" and "data.on_exhausted=renormalise" in found["math"].fix
    step = int(re.search(r"met at step ([\d,]+): the run stops", found["math"].what)[1].replace(",", ""))
    assert round(0.8 * step) <= cap < round(0.8 * (step + 1))  # 4 windows a step, 20% of them math
    assert f"the plan draws {2 * step * SEQ:,}" in found["web"].what  # half of each step, until the cap
    assert found["code"].level == "ok"


def test_lm_prepare_tokenizes_every_source_with_one_tokenizer_trained_on_a_weighted_sample(
    corpora, tmp_path, capsys
):
    text = corpora["web"].parents[1] / "text"
    sources = ",".join(
        f"{{name:{n},weight:{w},data:{{source:text,paths:['{text / n}/*.txt']}}}}"
        for n, w in [("web", 0.7), ("math", 0.3)]
    )
    overrides = [
        "data=mixture", f"data.mixture=[{sources}]", f"data.vocab_size={VOCAB}", f"data.seq_len={SEQ}",
        f"data.cache_dir={tmp_path / 'cache'}", "data.num_proc=1", "data.tokenizer_sample_bytes=60000",
    ]  # fmt: skip
    assert lm(["prepare", *overrides]) is None
    printed = capsys.readouterr().out
    assert "prepared web (weight 0.7)" in printed and "prepared math (weight 0.3)" in printed
    cfg = to_objects(compose(overrides)).data
    shared = Path(shared_tokenizer(cfg, train=False))
    assert shared.parent == tmp_path / "cache" and shared.name.startswith("mixture-tokenizer-")
    folders = [Path(line.split(": ")[1]) for line in printed.splitlines() if line.startswith("prepared ")]
    assert {load_manifest(f)["tokenizer_sha256"] for f in folders} == {file_sha256(shared)}
    dm = MixtureDataModule(cfg)
    dm.check_prepared()  # found prepared, with the same tokenizer, without training another
    assert dm.folders == folders
