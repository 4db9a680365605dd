"""Hydra callbacks of a training invocation (`conf/train.yaml`'s `hydra.callbacks`) that check before Hydra
writes anything."""

from __future__ import annotations

import copy
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

from lm.config import to_objects
from lm.store.exits import EXIT_CONFIG


class CheckBeforeRun(Callback):
    """Hydra callback (conf/train.yaml): a single run's config is checked by `to_objects` before Hydra makes
    the invocation's output folder (`hydra/<time>/` in the run directory), so a refused config changes
    nothing on disk. Each job of a multirun is checked by `lm.run.train.main` instead, where a refusal fails that
    job alone and the sweep goes on."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        task = copy.deepcopy(config)
        with read_write(task), open_dict(task):
            del task["hydra"]  # what the task receives (hydra's run_job strips it the same way)
        try:
            to_objects(task)
        except ValueError as e:
            # Hydra turns an exception in a callback into a warning and runs the job anyway; an exit passes.
            print(f"train.py: {e}", file=sys.stderr)
            raise SystemExit(EXIT_CONFIG) from e
