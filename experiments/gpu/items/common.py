"""What the ledger's items share: the time left in the item's box, running `train.py` and `lm` verbs as
subprocesses (their output into the item's log), reading a run's TensorBoard scalars and checkpoints, and the
one result line the scheduler parses.

Items run from the repository root with `src/` and the carried wheels on PYTHONPATH (run.sh), so `lm` is
imported from this checkout, never from an installed copy.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
WORK = Path(os.environ.get("LEDGER_WORK", "/tmp/lm-gpu-ledger/manual"))
DEADLINE = float(os.environ.get("LEDGER_DEADLINE", time.time() + float(os.environ.get("LEDGER_BOX_S", 600))))
DATA = ["data.vocab_size=32000", "data.seq_len=2048", "data.num_workers=4"]
"""plan_1b's data: the 32K tokenizer and shards run.sh prepares once for every item (seq_len is not in the
cache key)."""
STANDIN = os.environ.get("LEDGER_CPU_STANDIN") == "1"
"""Run the item's own logic on a CPU with a tiny model (to check the item, never to record a number)."""
TINY = [
    "trainer=cpu",
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=4",
    "data.vocab_size=512",
    "data.seq_len=64",
    "data.num_workers=0",
    "data.max_bytes=1500000",
    "data.tokenizer_sample_bytes=500000",
    "precision=fp32",
    "kernels=eager",
]
"""The test suite's tiny CPU model (tests/conftest.py), for LEDGER_CPU_STANDIN=1."""
QUIET = [
    "evals=off",
    "sampling=off",
    "early_stopping=off",
    "trainer.enable_progress_bar=false",
    "logger=tensorboard",
]
"""What a measurement does not need: milestone evaluations and samples, the stopper, the progress bar."""


def left(reserve: float = 10.0) -> float:
    """Seconds until this item's box ends, less `reserve` for printing its result."""
    return DEADLINE - time.time() - reserve


def say(*parts) -> None:
    print(*parts, flush=True)


def result(summary: str, **fields) -> None:
    """The line the scheduler records: `summary` goes to the README's table, the rest into the ledger."""
    if STANDIN:
        summary, fields["standin"] = f"CPU STAND-IN (tiny model, not a GPU number): {summary}", True
    print("LEDGER_RESULT " + json.dumps({"summary": summary, **fields}, default=str), flush=True)


def main(fn) -> None:
    """Run an item's `fn`; an exception still leaves a result line (failed, with its message)."""
    try:
        fn()
    except Exception as e:
        import traceback

        traceback.print_exc()
        result(f"failed: {type(e).__name__}: {e}"[:300], status="failed")
        sys.exit(1)


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, float]:
    """(exit code or None when cut at `timeout`, seconds) of a command, its output into this item's log."""
    say(f"$ {' '.join(cmd)}  # timeout {timeout:.0f} s")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})})
    try:
        code = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        stop(proc)
        code = None
    seconds = time.monotonic() - started
    say(f"# exit {code} after {seconds:.1f} s")
    return code, seconds


def stop(proc: subprocess.Popen, grace: float = 8.0) -> None:
    """SIGTERM (a training run saves and exits), SIGKILL after `grace`. Children stay in the item's process
    group, so whatever they leave behind the scheduler ends with the item."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def train(
    root: Path, name: str, overrides: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, float]:
    """`python train.py` for run `root/name` (a SIGTERM-cut run exits 75)."""
    args = [*overrides, f"run.root={root}", f"run.name={name}"]
    return run([sys.executable, "train.py", *args], timeout, env)


def lm(verb: str, args: list[str], timeout: float) -> tuple[int | None, float]:
    """`lm VERB ...` as `python -m lm.cli` (on the device lm is on PYTHONPATH, not installed)."""
    return run([sys.executable, "-m", "lm.cli", verb, *args], timeout)


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one TensorBoard scalar of a run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def steady(run_dir: Path, tag: str, skip: int) -> float | None:
    """The median of a logged rate from step `skip` on (compile and the first steps left out)."""
    values = [v for s, v in scalars(run_dir, tag) if s >= skip]
    return statistics.median(values) if values else None


def last_checkpoint(run_dir: Path) -> dict:
    from lm.checkpoint import files

    return files.read(run_dir / "checkpoints" / "last.ckpt")


def core_dir() -> Path:
    """LM_CORE_DATA (a copy the device call carries), else the checkout's neighbour or its own shared/."""
    env = [Path(os.environ["LM_CORE_DATA"])] if os.environ.get("LM_CORE_DATA") else []
    for candidate in (*env, REPO.parent / "shared/evals/core", REPO / "shared/evals/core"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        "no CORE task files beside the checkout (../shared/evals/core or shared/evals/core)"
    )


def gpu() -> dict:
    """What the measurement ran on, from torch itself."""
    import torch

    if not torch.cuda.is_available():
        return {"device": "no CUDA device", "torch": torch.__version__}
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
    }
