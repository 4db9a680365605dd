"""Evaluation beyond the loss: validation bits per byte, `lm eval` (lm-evaluation-harness on a bundled local
task, offline) and benchmarks at milestones (`evals=`), on one tiny trained run shared by the module."""

import json
import math
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from tokenizers import Tokenizer

from lm import cli
from lm.base.exits import EXIT_CONFIG, Refused, exit_code
from lm.config import register_configs, to_objects
from lm.data import load_manifest, load_tokenizer, shard_paths
from lm.data.bytes import token_byte_lengths
from lm.data.dataset import TokenWindows, val_batches
from lm.data.tokenizer import EOT_ID, train_tokenizer
from lm.engine.module import LMModule
from lm.evals import evaluate
from lm.evals.findings import evals_findings
from lm.interop.hf import hf_tokenizer, load_run, to_hf_model
from lm.run.report import write_report
from lm.run.train import main
from lm.store import rundir

from ..conftest import CONF, TINY
from ..run.test_train import scalars

TASKS = Path(__file__).parents[1] / "fixtures" / "eval_tasks"
EVALS = [
    "evals.tasks=[tiny_mc]",
    f"evals.include_path={TASKS}",
    "evals.batch_size=8",
    "phases.phases=[{name:first,end_step:2},{name:second,end_step:6}]",
    "sampling.prompts=[]",
    "trainer.val_every_steps=4",
    "trainer.limit_val_batches=3",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No network, as on a cluster node without one: everything here is local."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def run_config(root: Path, data_cache: Path, *overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            "train", overrides=[*TINY, f"run.root={root}", f"data.cache_dir={data_cache}", *EVALS, *overrides]
        )


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_cache) -> Path:
    """A 4-step tiny run evaluated on the local task at the phase boundary (step 2) and its last step."""
    root = tmp_path_factory.mktemp("evals")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        main(run_config(root, data_cache, "trainer.max_steps=4"))
    return root / "smoke"


def test_byte_lengths_spell_the_utf8_text_and_end_of_text_is_none():
    tokenizer = train_tokenizer(["héllo wörld ∑ naïve text, déjà vu "] * 50, vocab_size=300)
    lengths = token_byte_lengths(tokenizer, 320)  # a padded vocabulary: the padding ids are 0 bytes
    text = "naïve ∑ wörld<|endoftext|>déjà vu"
    ids = tokenizer.encode(text).ids
    assert int(lengths[ids].sum()) == len(text.replace("<|endoftext|>", "").encode("utf-8"))
    assert lengths[EOT_ID] == 0 and not lengths[300:].any()


@pytest.mark.slow  # over ~15 s on 2 cores: CI's second pass
def test_val_bpb_is_the_validation_nats_over_the_bytes_of_text(tiny_cfg, tmp_path, data_cache):
    main(tiny_cfg("trainer.max_steps=2", "trainer.val_every_steps=2", "trainer.limit_val_batches=3"))
    run = tmp_path / "runs" / "smoke"
    (step, bpb), *_ = scalars(run, "val/bpb")[-1:]
    # By hand: the checkpoint's summed nats over the validated windows, and the UTF-8 bytes the tokenizer
    # decodes their targets to (the whole stretch at once, end-of-text left out).
    folder = next(p for p in data_cache.iterdir() if (p / "manifest.json").is_file())
    manifest = load_manifest(folder)
    windows = TokenWindows(shard_paths(folder, manifest, "val"), 64, manifest["dtype"])
    batches = val_batches(len(windows), 8)[:3]
    model = LMModule.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu").model.eval()
    nats = 0.0
    with torch.no_grad():
        for idx in batches:
            x = torch.stack([windows[i] for i in idx])
            logits = model(x[:, :-1])
            nats += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
    ids = torch.cat([windows[i][1:] for idx in batches for i in idx]).tolist()
    n_bytes = len(load_tokenizer(folder).decode(ids, skip_special_tokens=True).encode("utf-8"))
    assert step == 1
    assert bpb == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


def test_evals_without_lm_eval_are_refused_before_the_run_starts(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if the eval extra were not installed
    with pytest.raises(Refused, match=r"evals .*pip install -e '\.\[eval\]'"):
        main(tiny_cfg("evals.tasks=[tiny_mc]", f"evals.include_path={TASKS}"))
    assert not (tmp_path / "runs" / "smoke").exists()


@pytest.mark.slow  # lm-eval and transformers take ~10 s to import; the run evaluates twice
def test_milestones_are_evaluated_logged_and_charged_to_eval(run):
    records = rundir.read_evals(run)
    assert [r["step"] for r in records] == [2, 4]  # the phase boundary, then the last step
    assert [r["phase"] for r in records] == ["first", "second"]
    for r in records:
        assert set(r["scores"]["tiny_mc"]) >= {"acc", "acc_norm", "acc_stderr"}
        assert 0.0 <= r["scores"]["tiny_mc"]["acc"] <= 1.0
    # TensorBoard has each milestone at the index of its last batch, as val/loss.
    assert [s for s, _ in scalars(run, "eval/tiny_mc/acc")] == [1, 3]
    # The evaluations' time is in the eval bucket, beside validation; training time does not hold it.
    ledger = rundir.read_ledger(run)
    assert ledger["seconds"]["eval"] >= sum(r["seconds"] for r in records)
    # The report: accuracy against dollars needs a price (none on a CPU); the table and the phase column.
    report = write_report(run).read_text()
    assert "## Benchmarks" in report and "tiny_mc acc_norm" in report
    assert report.count("| benchmark |") == 1


@pytest.mark.slow  # lm-eval and transformers take ~10 s to import; the run evaluates twice
def test_a_resumed_run_does_not_evaluate_a_milestone_again(run, tmp_path, data_cache):
    shutil.copytree(run, tmp_path / "smoke")
    main(run_config(tmp_path, data_cache, "trainer.max_steps=6"))
    lines = [json.loads(line) for line in (tmp_path / "smoke" / rundir.EVALS).read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4, 6]  # 6 is the second phase's end and the last step


def local_tasks(folder: Path, *names: str) -> Path:
    """A folder of task YAMLs: the bundled local task under each of `names` (each its own task)."""
    folder.mkdir()
    for name in ("tiny_mc.py", "tiny_mc.jsonl"):
        shutil.copy(TASKS / name, folder / name)
    for name in names:
        (folder / f"{name}.yaml").write_text(
            (TASKS / "tiny_mc.yaml").read_text().replace("task: tiny_mc", f"task: {name}")
        )
    return folder


@pytest.mark.slow  # lm-eval indexes its thousands of built-in tasks to know arc_easy (~10-20 s)
def test_the_doctor_refuses_a_task_whose_data_is_out_of_reach(tmp_path, tiny_cfg):
    """Offline, arc_easy's data is neither cached nor downloadable: refused before the run (the doctor had
    said `OK evals`), naming that task alone; a local task with its data file missing is refused too."""
    tasks = local_tasks(tmp_path / "tasks", "local_a", "local_b")
    found = evals_findings(
        to_objects(tiny_cfg("evals.tasks=[local_a,local_b,arc_easy]", f"evals.include_path={tasks}")).evals
    )
    errors = [f.what for f in found if f.level == "error"]
    assert len(errors) == 1 and errors[0].startswith(
        "task arc_easy's data cannot be had here: not in the local cache"
    )
    assert "allenai/ai2_arc" in errors[0] and "the Hub cannot be reached" in errors[0]
    (tasks / "tiny_mc.jsonl").unlink()
    with pytest.raises(
        Refused, match=r"task local_a's data cannot be had here: FileNotFoundError"
    ) as refused:
        main(tiny_cfg("evals.tasks=[local_a]", f"evals.include_path={tasks}"))
    assert exit_code(refused.value) == EXIT_CONFIG and not (tmp_path / "runs" / "smoke").exists()


@pytest.mark.slow  # lm-eval and transformers take ~10 s to import, and index the built-in tasks
def test_a_failing_benchmark_costs_only_its_own_scores(tmp_path, data_cache, caplog, monkeypatch):
    """A task that fails at a milestone (the doctor is off; or the data went out of reach mid-run) is
    logged with its cause, in evals.jsonl and the log; the other tasks' scores are kept and training goes
    on. (Before, one unreachable task lost the whole milestone: no evals.jsonl line at all.)"""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # no ~25 s of retries
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    tasks = local_tasks(tmp_path / "tasks", "local_a", "local_b")
    overrides = [
        "evals.tasks=[local_a,local_b,arc_easy]",
        f"evals.include_path={tasks}",
        "doctor.enabled=false",
    ]
    main(run_config(tmp_path, data_cache, "trainer.max_steps=2", *overrides))
    run = tmp_path / "smoke"
    [record] = rundir.read_evals(run)
    assert record["step"] == 2 and set(record["scores"]) == {"local_a", "local_b"}
    assert record["scores"]["local_a"] == record["scores"]["local_b"]  # the same task under two names
    assert list(record["errors"]) == ["arc_easy"] and "allenai/ai2_arc" in record["errors"]["arc_easy"]
    assert "benchmark arc_easy at step 2 failed; the other tasks are kept: ConnectionError" in caplog.text
    assert (run / "checkpoints" / "step-2.ckpt").is_file()


@pytest.mark.slow  # lm-eval indexes its thousands of built-in tasks to know arc_easy (~10-20 s)
def test_lm_eval_refuses_an_unreachable_task_in_one_line_before_loading_the_model(run, monkeypatch):
    """`lm eval --tasks arc_easy` offline printed a 55-77-line traceback after loading the model."""
    loaded = []
    monkeypatch.setattr(evaluate.hf, "load_run", lambda *a, **k: loaded.append(a))
    with pytest.raises(SystemExit) as refused:
        cli.main(["eval", str(run), "--tasks", "tiny_mc,arc_easy", "--include-path", str(TASKS)])
    message, code = str(refused.value), refused.value.code
    assert message.startswith("lm eval: the data of lm-eval task(s) arc_easy cannot be had here")
    assert "\n" not in message and "tiny_mc" not in message and loaded == [] and code == EXIT_CONFIG


def lm_loglikelihood(model, tokenizer: Tokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context) from lm's own model, tokenized as lm-eval does: trailing whitespace of
    the context moves to the continuation, the whole string is encoded and split where the context ends."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped) :] + continuation
    ctx = tokenizer.encode(context).ids
    whole = tokenizer.encode(context + continuation).ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole[:-1]])).double(), dim=-1)[0]
    return sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


@pytest.mark.slow  # lm-eval and transformers take ~10 s to import; the run evaluates twice
def test_lm_eval_gives_lms_own_loglikelihoods(run, tmp_path, monkeypatch):
    # A copy of the run elsewhere, with an empty data cache: all it needs is in the run directory.
    copy = tmp_path / "copied"
    shutil.copytree(run, copy)
    monkeypatch.setenv("LM_CACHE", str(tmp_path / "empty"))
    generators = torch.random.get_rng_state(), random.getstate()
    cli.main(["eval", str(copy), "--tasks", "tiny_mc", "--include-path", str(TASKS), "--samples"])
    # Building the HF copy draws weights and lm-eval seeds every generator: they are given back as they were.
    assert torch.equal(torch.random.get_rng_state(), generators[0]) and random.getstate() == generators[1]
    record = json.loads((copy / rundir.EVAL).read_text())
    loaded = load_run(copy)
    tokenizer = Tokenizer.from_file(str(loaded.tokenizer_path))
    samples = record["samples"]["tiny_mc"]
    assert len(samples) == 12
    for s in samples:
        for (context, continuation), ll in zip(s["requests"], s["responses"], strict=True):
            assert ll == pytest.approx(
                lm_loglikelihood(loaded.model, tokenizer, context, continuation), abs=1e-4
            )
    # The table is written beside it, and the report shows it.
    assert "| tiny_mc | acc |" in (copy / rundir.EVAL_MD).read_text()
    assert "`lm eval` of" in write_report(copy).read_text()

    # A Hugging Face folder of the same model (as `lm export` writes one) scores the same.
    hf_dir = tmp_path / "hf"
    to_hf_model(loaded.model, eos_id=loaded.eot_id).save_pretrained(hf_dir)
    hf_tokenizer(loaded.tokenizer_path, loaded.eot_token).save_pretrained(hf_dir)
    cli.main(["eval", str(hf_dir), "--tasks", "tiny_mc", "--include-path", str(TASKS)])
    # ...written beside the folder, not into it: an upload of the folder carries no local evaluation.
    assert json.loads((tmp_path / "hf.eval.json").read_text())["scores"] == record["scores"]
    assert "| tiny_mc | acc |" in (tmp_path / "hf.eval.md").read_text()
    assert not (hf_dir / rundir.EVAL).exists() and not (hf_dir / rundir.EVAL_MD).exists()
    cli.main(["eval", str(hf_dir), "--tasks", "tiny_mc", "--include-path", str(TASKS), "--into-folder"])
    assert json.loads((hf_dir / rundir.EVAL).read_text())["scores"] == record["scores"]


@pytest.mark.slow  # lm-eval indexes its thousands of built-in tasks to say a name is unknown (~10 s)
def test_an_unknown_task_is_refused_naming_the_fix(run, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", str(run), "--tasks", "tiny_mc,no_such_task", "--include-path", str(TASKS)])
    assert "no_such_task" in str(e.value) and "--include-path" in str(e.value) and e.value.code == EXIT_CONFIG
