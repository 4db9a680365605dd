"""Hydra callbacks of a training invocation (`conf/train.yaml`'s `hydra.callbacks`) that check before Hydra
writes anything."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from lm.base.exits import EXIT_CONFIG, Refused
from lm.config import to_objects

INVOCATION: dict[str, Path] = {}
"""This invocation's folder (`output_dir`, `hydra/<time>/`) and run directory (`run_dir`), known before Hydra
makes the folder: where `train.py` looks when Hydra's own writes there fail (a full or read-only disk)."""


class CheckBeforeRun(Callback):
    """Hydra callback (conf/train.yaml): a single run's config is checked by `to_objects` before Hydra makes
    the invocation's output folder (`hydra/<time>/` in the run directory), so a refused config changes
    nothing on disk. Each job of a multirun is checked by `lm.run.train.main` instead, where a refusal fails that
    job alone and the sweep goes on."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Resolved on Hydra's own config: `${now:}` is cached there, so this is the folder it makes next.
        INVOCATION["output_dir"] = Path(os.path.abspath(OmegaConf.select(config, "hydra.run.dir")))
        INVOCATION["run_dir"] = Path(os.path.abspath(Path(config.run.root, config.run.name)))
        task = copy.deepcopy(config)
        with read_write(task), open_dict(task):
            del task["hydra"]  # what the task receives (hydra's run_job strips it the same way)
        try:
            to_objects(task)
        except Refused as e:
            # Hydra turns an exception in a callback into a warning and runs the job anyway; an exit passes.
            print(f"train.py: {e}", file=sys.stderr)
            raise SystemExit(EXIT_CONFIG) from e
