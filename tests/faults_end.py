"""Test-only faults in a run's optional work (samples, benchmarks, the report) and at its end, added to a run as
`+callbacks.endfault._target_=tests.faults_end.EndFault ...` (`tests.test_faults_end.end_fault` writes them).

Each fault is armed at set-up on one rank (`rank`; every rank when None) and fires at optimizer step `step`;
it replaces one name the callback layer calls (the sampler's `complete`, the evaluator's `subject`: the model lm's
scorer and lm-eval reach, the run's `write_report`), so the failure rises from inside the real work, as an
out-of-memory or a changed data file would. Nothing inside lm.evals or lm.interop is patched. The marker is written when the fault fires: its mtime is the
moment the test measures the exit from.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl

from tests.faults import fill
from tests.faults_process import BALLAST


def rank() -> int:
    """This process's rank: torchrun sets RANK, Lightning's launcher LOCAL_RANK (one machine)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


class EndFault(pl.Callback):
    """action:
    sample_raises    the milestone sampler's generation raises (rank 0 samples)
    core_raises      lm's CORE scorer raises on reaching the model, while this rank scores its share
    harness_raises   the transformers copy lm-eval scores cannot be made (rank 0 runs lm-eval)
    report_raises    the report's writer raises (rank 0 writes it)
    raise_at_end     this callback raises in its own `on_train_end` (a user callback's bug at the end)
    fill_disk        the filesystem of `path` fills up at step `step` (a ballast file there), before the
                     final save
    """

    def __init__(
        self, action: str, marker: str, step: int = 0, rank: int | None = None, path: str = ""
    ) -> None:
        self.action, self.marker, self.step, self.rank = action, Path(marker), step, rank
        self.path = Path(path)
        self.replaced: list[tuple[object, str, object]] = []
        """(module, name, original) of what `setup` replaced, put back at teardown (a run in a test process)."""

    def replace(self, module: object, name: str, value: object) -> None:
        self.replaced.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        while self.replaced:
            module, name, original = self.replaced.pop()
            setattr(module, name, original)

    def mine(self) -> bool:
        return self.rank is None or rank() == self.rank

    def fire(self, trainer: pl.Trainer) -> None:
        """Raise the injected fault (at step `step`), leaving the marker."""
        if trainer.global_step != self.step:
            return
        self.marker.write_text(self.action)
        raise RuntimeError(f"injected fault: {self.action} at step {trainer.global_step} on rank {rank()}")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.mine():
            return
        fault = self
        if self.action == "sample_raises":
            from lm.callbacks import milestone_samples

            def complete(*args, **kwargs):
                fault.fire(trainer)

            self.replace(milestone_samples, "complete", complete)
        if self.action in ("core_raises", "harness_raises"):
            evaluator = next(c for c in trainer.callbacks if type(c).__name__ == "BenchmarkEvaluator")
            self.replace(evaluator, "subject", self.failing_subject(trainer, evaluator.subject))
        if self.action == "report_raises":
            from lm.run import train

            def write_report(*args, **kwargs):
                fault.fire(trainer)

            train.write_report = write_report  # after teardown: left in place (a subprocess's run only)

    def failing_subject(self, trainer: pl.Trainer, subject):
        """The evaluator's `subject` (what lm.evals scores), failing at step `step`: `core_raises`, the model as
        lm's scorer reaches it (before the counts' reduce, as an out-of-memory in a forward); `harness_raises`,
        its transformers copy for lm-eval."""
        fault = self

        class Failing:
            def __init__(self, backbone) -> None:
                self.backbone = backbone
                self.device = backbone.device  # read by lm.evals before the scoring starts

            def __getattr__(self, name):
                fault.fire(trainer)
                return getattr(self.backbone, name)

            def __call__(self, *args, **kwargs):
                fault.fire(trainer)
                return self.backbone(*args, **kwargs)

        def made(*args, **kwargs):
            made_subject = subject(*args, **kwargs)
            if trainer.global_step != fault.step:
                return made_subject  # the real one: its type is what lm.evals dispatches on
            if fault.action == "core_raises":
                made_subject.backbone = Failing(made_subject.backbone)
            else:
                transformers = made_subject.transformers

                def failing_transformers():
                    fault.fire(trainer)
                    return transformers()

                made_subject.transformers = failing_transformers
            return made_subject

        return made

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        at_step = self.action == "fill_disk" and self.mine() and trainer.global_step == self.step
        if at_step and not self.marker.exists():
            self.marker.write_text(self.action)
            fill(self.path / BALLAST)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.action == "raise_at_end" and self.mine():
            self.fire(trainer)
