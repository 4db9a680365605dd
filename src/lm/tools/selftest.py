"""`lm selftest`: on the machine it runs on, run every path a config's run would take, in minutes, before paying for
hours of it (`lm selftest [--keep DIR] [--layers K] [overrides...]`).

Each check is a row (check, pass/fail/skip, seconds, what it saw, the fix): `device` (precision, compile,
Liger, optimizer, the SDPA backend actually picked), `train` (a short run, the model cut to `--layers` blocks:
paths are per block, depth adds only time; guards armed, a sample, a checkpoint, a bundled evaluation),
`sigterm` (save and exit 75), `resume` (bitwise equal to the uninterrupted run; a second uninterrupted run tells
a resume bug from non-deterministic kernels), `sample`, `eval`, `export` (transformers gives lm's logits),
`ddp` (two ranks stop at one step) and `speed` (tokens/s and MFU against what `lm plan` assumes). Exit 0 when
nothing failed, else 1; on a CPU the GPU rows skip and say why."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch

from lm.base.exits import EXIT_PREEMPTED
from lm.checkpoint import files
from lm.config import LMConfig, compose, conf_dir, to_objects
from lm.engine import runtime
from lm.numbers import cost
from lm.store import rundir
from lm.store.bench_file import measured_mfu

TASKS = Path(__file__).parent / "selftest_task"
"""The bundled evaluation task (4 questions, offline)."""
STEPS = 8
CUT_AT = 5
"""SIGTERM after this step: its save lands at step 6, between the periodic checkpoints at 4 and 8."""
RUN_TIMEOUT_S = 600
SPEED_MIN = 0.5
"""The speed check fails below this fraction of the MFU a plan assumes (a throttled or misconfigured GPU)."""


@dataclass
class Check:
    """One row of the table."""

    name: str
    status: str
    """`pass`, `fail` or `skip`."""
    seconds: float
    saw: str
    fix: str = ""


class SigtermAt(pl.Callback):
    """Send this process SIGTERM once `step` optimizer steps are done, as a spot reclaim would."""

    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.sent and trainer.global_step >= self.step:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


class SelfTest:
    """The checks of one config, in a scratch run root."""

    def __init__(self, overrides: list[str], root: Path, layers: int = 2) -> None:
        self.overrides, self.root = overrides, root
        self.cfg: LMConfig = to_objects(compose(overrides))
        self.layers = min(layers, self.cfg.model.n_layer)
        self.checks: list[Check] = []
        c = self.cfg
        self.rt = runtime.resolve(c.trainer, c.gpu, c.precision, c.kernels, c.optim, c.cost)

    # -- the runs ----------------------------------------------------------------------------------------

    def run_args(self, name: str, steps: int = STEPS, *extra: str) -> list[str]:
        evals = []
        if has("lm_eval"):
            evals = [
                "evals.tasks=[lm_selftest_mc]",
                f"evals.include_path={TASKS}",
                "evals.limit=4",
                "evals.batch_size=4",
                "evals.at_phase_ends=false",
                "evals.at_last_step=true",
            ]
        return [
            *self.overrides,
            f"run.root={self.root}",
            f"run.name={name}",
            f"model.n_layer={self.layers}",
            f"trainer.max_steps={steps}",
            f"optim.total_steps={STEPS}",  # every invocation follows the whole run's schedule
            "optim.warmup_steps=2",
            "checkpoint.every_n_steps=4",
            "trainer.val_every_steps=4",
            "trainer.limit_val_batches=1",
            "sampling.steps=[4]",
            "sampling.max_new_tokens=8",
            "sampling.at_phase_ends=false",
            "early_stopping=off",
            *evals,
            *extra,
        ]

    def train(self, args: list[str]) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(conf_dir().parent / "train.py"), *args]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(cmd, -1, str(e.stdout or ""), f"timed out after {e.timeout} s")

    def last(self, name: str) -> dict:
        return files.read(self.root / name / rundir.CHECKPOINTS / files.LAST)

    # -- the checks --------------------------------------------------------------------------------------

    def check(self, name: str, fn: Callable[[], tuple[str, str, str]]) -> bool:
        """Run one check; an exception is its failure, with the message as what it saw. Each check says on
        stderr when it starts and how it ended, so a selftest stopped from outside still shows how far it got."""
        print(f"lm selftest: {name} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            status, saw, fix = fn()
        except Exception as e:  # a check that breaks is a failed check, never a crashed selftest
            status, saw, fix = "fail", f"{type(e).__name__}: {e}"[:300], ""
        self.checks.append(Check(name, status, time.monotonic() - started, saw, fix))
        print(
            f"lm selftest: {name} {status.upper()} ({self.checks[-1].seconds:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        return status == "pass"

    def device(self) -> tuple[str, str, str]:
        c, rt = self.cfg, self.rt
        runtime.set_matmul_precision(c.precision.tf32)
        optimizer = "Muon + AdamW" if c.optim.name == "muon" else "AdamW"
        optimizer += " (fused)" if rt.fused_adamw else " (for-each)"
        saw = (
            f"{rt.device_name} ({rt.gpu.name}); precision {rt.precision_label}, tf32 {c.precision.tf32}, "
            f"compile {rt.compile}, liger {c.kernels.liger}, {optimizer}, SDPA {sdpa_backend(c, rt)}"
        )
        return "pass", saw, ""

    def reference(self) -> tuple[str, str, str]:
        done = self.train(self.run_args("ref"))
        if done.returncode != 0:
            return (
                "fail",
                f"exit {done.returncode}: {tail(done)}",
                "run it: python train.py " + " ".join(self.overrides),
            )
        ckpt = self.last("ref")
        guards = ckpt["run_state"]["guards"]
        armed = f"guards armed: {guards['skipped']} non-finite and {guards['spikes']} spiking steps skipped"
        return "pass", f"{ckpt['global_step']} steps, exit 0; {armed}", ""

    def sigterm(self) -> tuple[str, str, str]:
        hook = [
            "+callbacks.lm_selftest_sigterm._target_=lm.tools.selftest.SigtermAt",
            f"+callbacks.lm_selftest_sigterm.step={CUT_AT}",
        ]
        done = self.train(self.run_args("cut", STEPS, *hook))
        if done.returncode != EXIT_PREEMPTED:
            return "fail", f"exit {done.returncode} (expected {EXIT_PREEMPTED}): {tail(done)}", ""
        step = self.last("cut")["global_step"]
        return "pass", f"saved at step {step}, exit {EXIT_PREEMPTED}", ""

    def resume(self) -> tuple[str, str, str]:
        done = self.train(self.run_args("cut"))
        if done.returncode != 0:
            return "fail", f"resume: exit {done.returncode}: {tail(done)}", ""
        diff = max_difference(self.last("ref"), self.last("cut"))
        if diff == 0.0:
            return "pass", f"step {STEPS} after the resume equals the uninterrupted run bit for bit", ""
        again = self.train(self.run_args("ref2"))
        noise = max_difference(self.last("ref"), self.last("ref2")) if again.returncode == 0 else None
        if noise:
            return (
                "fail",
                f"resumed differs by {diff:.3g}, but so do two uninterrupted runs ({noise:.3g}): kernels "
                "that are not deterministic on this device, not the resume",
                "torch.use_deterministic_algorithms / CUBLAS_WORKSPACE_CONFIG=:4096:8 to compare bitwise",
            )
        return "fail", f"resumed run differs from the uninterrupted one by {diff:.3g}", "report it: a bug"

    def sample(self) -> tuple[str, str, str]:
        records = rundir.read_samples(self.root / "ref")
        if not records:
            return "fail", "no milestone sample in samples.jsonl", ""
        return (
            "pass",
            f"{len(records)} sample(s) at step {records[0]['step']}: {records[0]['text'][:40]!r}",
            "",
        )

    def evaluate(self) -> tuple[str, str, str]:
        if not has("lm_eval"):
            return "skip", "lm-evaluation-harness is not installed", "pip install -e '.[eval]'"
        records = rundir.read_evals(self.root / "ref")
        scores = records[-1].get("scores", {}) if records else {}
        if "lm_selftest_mc" not in scores:
            return (
                "fail",
                f"no score of the bundled task in evals.jsonl ({records[-1] if records else 'empty'})",
                "",
            )
        return "pass", f"lm_selftest_mc {json.dumps(scores['lm_selftest_mc'])[:80]}", ""

    def export(self) -> tuple[str, str, str]:
        if not has("transformers"):
            return "skip", "transformers is not installed", "pip install -e '.[export]'"
        from transformers import AutoModelForCausalLM  # deferred: the export extra

        from lm.interop.hf import load_run
        from lm.tools.export import export

        folder = export(self.root / "ref", self.root / "hf")
        hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        ours = load_run(self.root / "ref").model.float().eval()
        ids = torch.randint(0, hf.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            diff = (ours(ids)[..., : hf.config.vocab_size] - hf(ids).logits).abs().max().item()
        status = "pass" if diff < 1e-3 else "fail"
        return status, f"transformers loads it; max |logit difference| {diff:.2g} (fp32)", ""

    def ddp(self) -> tuple[str, str, str]:
        if not self.rt.cuda or torch.cuda.device_count() < 2:
            return "skip", "one device: no all-reduce or stop agreement to check", ""
        hook = [
            "+callbacks.lm_selftest_sigterm._target_=lm.tools.selftest.SigtermAt",
            f"+callbacks.lm_selftest_sigterm.step={CUT_AT}",
        ]
        done = self.train(self.run_args("ddp", STEPS, "trainer=ddp", "trainer.devices=2", *hook))
        if done.returncode != EXIT_PREEMPTED:
            return "fail", f"exit {done.returncode} (expected {EXIT_PREEMPTED}): {tail(done)}", ""
        return (
            "pass",
            f"2 ranks, NCCL all-reduce; SIGTERM on both: one save at step {self.last('ddp')['global_step']}",
            "",
        )

    def speed(self) -> tuple[str, str, str]:
        from lm.tools.bench import run_one  # deferred: the bench's worker machinery

        row = run_one([*self.overrides, "bench.warmup_steps=3", "bench.steps=5"], [], RUN_TIMEOUT_S)
        if row.status != "ok":
            return "fail", f"{row.status}: {row.error}", "lm bench with the same overrides says more"
        saw = f"{row.tokens_per_sec:,.0f} tokens/s"
        if row.mfu is None:
            return "skip", saw + "; no catalogued peak on this device: no MFU to compare", ""
        gpu = self.rt.gpu
        n_params = cost.non_embedding_params(self.cfg.model)
        ratio = cost.fp8_peak_ratio(gpu)
        bench = measured_mfu(Path(self.cfg.bench.out_dir), gpu.name, self.cfg.model, n_params, ratio)
        if bench and self.rt.fp8:  # the bench's MFU is against the bf16 peak; this row's against FP8's
            bench /= ratio
        expected = bench or cost.ASSUMED_MFU
        where = "bench.json" if bench else "the assumed MFU"
        saw += f", MFU {row.mfu:.1%} against {expected:.1%} ({where})"
        if row.mfu < SPEED_MIN * expected:
            return "fail", saw, "lm doctor names forgotten optimizations; lm bench compares knobs"
        return "pass", saw, ""

    def run(self) -> list[Check]:
        self.check("device", self.device)
        if self.check("train", self.reference):
            self.check("sample", self.sample)
            self.check("eval", self.evaluate)
            self.check("export", self.export)
            if self.check("sigterm", self.sigterm):
                self.check("resume", self.resume)
        self.check("ddp", self.ddp)
        self.check("speed", self.speed)
        return self.checks


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def tail(done: subprocess.CompletedProcess, lines: int = 2) -> str:
    text = (done.stderr or done.stdout or "").strip().splitlines()
    return " | ".join(line.strip() for line in text[-lines:])[:300]


def max_difference(a: dict, b: dict) -> float:
    """The largest absolute difference between two checkpoints' weights and optimizer state (0.0: bitwise)."""
    worst = 0.0
    for key in ("state_dict", "optimizer_states"):
        for x, y in zip(tensors(a[key]), tensors(b[key]), strict=True):
            if not torch.equal(x, y):  # NaNs that differ in place: infinitely different
                worst = max(worst, (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item())
    return worst


def tensors(state) -> list[torch.Tensor]:
    """Every tensor of nested state, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in tensors(state[k])]
    if isinstance(state, list | tuple):
        return [t for v in state for t in tensors(v)]
    return []


def sdpa_backend(cfg: LMConfig, rt: runtime.Runtime) -> str:
    """The attention kernel PyTorch picks for this model's shape on this device, as the profiler names it."""
    m = cfg.model
    device = "cuda" if rt.cuda and not rt.planned else "cpu"
    dtype = torch.bfloat16 if rt.precision.startswith("bf16") else torch.float32
    q = torch.randn(
        1, m.n_head, min(cfg.data.seq_len, 256), m.d_model // m.n_head, device=device, dtype=dtype
    )
    with torch.profiler.profile() as prof:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    names = [e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")]
    return names[0].removeprefix("aten::_scaled_dot_product_") if names else "unknown"


def table(checks: list[Check]) -> str:
    rows = [("check", "result", "seconds", "what it saw", "fix")]
    rows += [(c.name, c.status.upper(), f"{c.seconds:.1f}", c.saw, c.fix) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        "  ".join([*(r[i].ljust(widths[i]) for i in range(3)), r[3]] + ([f"-> {r[4]}"] if r[4] else []))
        for r in rows
    )


def selftest(overrides: list[str], keep: Path | None = None, layers: int = 2) -> int:
    """Run every check, print the table; 0 when none failed."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lm-selftest-") as tmp:
        root = keep or Path(tmp)
        checks = SelfTest(overrides, root, layers).run()
    print(table(checks))
    failed = [c.name for c in checks if c.status == "fail"]
    skipped = [c.name for c in checks if c.status == "skip"]
    minutes = (time.monotonic() - started) / 60
    print(
        f"\nlm selftest: {len(checks) - len(failed) - len(skipped)} passed, {len(failed)} failed"
        + (f", not checked here: {', '.join(skipped)}" if skipped else "")
        + f" ({minutes:.1f} min)"
    )
    return 1 if failed else 0
