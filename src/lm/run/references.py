"""Reference curves for the forecast (`early_stopping.forecast_reference`): a finished run directory, or a
recorded curve (JSON), read into `lm.numbers.reference.Curve` with the key it must share with the run."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lm.base.exits import Refused
from lm.config import DataConfig, OptimConfig
from lm.numbers.batch_ramp import ramp_of
from lm.numbers.reference import Curve, curve_key, mismatch
from lm.store import rundir

log = logging.getLogger(__name__)

VAL_TAG = "val/loss"


def read_reference(path: str | Path) -> Curve:
    """A run directory (its config.yaml and the `val/loss` it logged) or a JSON curve: lm's own form
    (name, steps, losses, total_steps, key) or a recorded benchmark curve (tests/fixtures/curves: optim,
    total_steps, tokens_per_step and the in-run validation `val_in_run`)."""
    path = Path(path)
    if path.is_dir():
        return Curve.from_record(run_directory_record(path))
    if path.is_file():
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise Refused(f"early_stopping.forecast_reference {path}: not a JSON curve ({e})") from e
        return Curve.from_record(record if "losses" in record else recorded_curve(record, path.stem))
    raise Refused(
        f"early_stopping.forecast_reference {path}: no such run directory or curve file; name a finished run "
        "(runs/<name>) or a curve JSON"
    )


def run_directory_record(run_dir: Path) -> dict[str, Any]:
    raw = rundir.read_config(run_dir)
    if raw is None:
        raise Refused(
            f"early_stopping.forecast_reference {run_dir}: no {rundir.CONFIG}; is it a run directory?"
        )
    optim, data = typed(raw, "optim", OptimConfig), typed(raw, "data", DataConfig)
    scalars = rundir.read_scalars(run_dir)
    for tag in (VAL_TAG, "train/tokens"):
        if tag not in scalars:
            raise Refused(f"early_stopping.forecast_reference {run_dir}: the run logged no {tag}")
    val, tokens = scalars[VAL_TAG], scalars["train/tokens"]
    # TensorBoard holds a step's scalars at the step before the trainer's global step (the stopper's).
    steps = [s + 1 for s in val.steps]
    total = optim.total_steps or int(raw.trainer.max_steps)  # the steps the schedule spans (RunPlan's rule)
    return {
        "name": str(run_dir),
        "steps": steps,
        "losses": list(val.values),
        "total_steps": total,
        "key": curve_key(optim, total, configured_tokens_per_step(raw, data, tokens), data),
    }


def configured_tokens_per_step(raw: DictConfig, data: DataConfig, tokens: Any) -> int:
    """The run's full optimizer step in tokens, batch x seq_len x accumulation x processes, as its plan counts it
    (`RunPlan.tokens_per_step`): not the tokens trained over the steps, an average under a batch ramp. The
    processes are read off what it trained against one process's ramp (`trainer.devices` may say `auto`)."""
    accumulate = int(raw.trainer.get("accumulate_grad_batches", 1))
    one = ramp_of(data, accumulate, 1)
    world = max(1, round(tokens.values[-1] / one.tokens_through(int(tokens.steps[-1]) + 1)))
    return one.tokens_per_step * world


def typed(raw: DictConfig, key: str, schema: type) -> Any:
    """One section of a saved config.yaml as its schema's dataclass (keys a later lm added take defaults)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw[key]))


def recorded_curve(record: dict[str, Any], name: str) -> dict[str, Any]:
    optim = OptimConfig(**{k: v for k, v in record["optim"].items() if k in OptimConfig.__dataclass_fields__})
    key = curve_key(
        optim, record["total_steps"], record["tokens_per_step"], None
    )  # no seq_len, seed recorded
    return {
        "name": record.get("name", name),
        "steps": [s + 1 for s in record["val_in_run"]["step"]],
        "losses": record["val_in_run"]["loss"],
        "total_steps": record["total_steps"],
        "key": key,
    }


def load_references(paths: list[str], run_key: dict[str, Any], required: bool = True) -> list[Curve]:
    """Every reference, each refused (`Refused`, naming the key) when it does not share the run's key.

    `required=False` (`forecast_model` other than `reference`: `lm plan --sibling` names a sibling that may
    not have run yet): a reference that is not there, or has not finished, is left out with a warning that
    says how to make it; one that differs from the run is still refused."""
    curves = []
    for path in paths:
        try:
            curves.append(read_reference(path))
        except Refused as e:
            if required or Path(path).is_file():  # a curve file that does not read is a mistake
                raise
            log.warning(
                "%s; the forecast goes without it (train the reference run to its end first, e.g. "
                "`python train.py +experiment=<plan>_sibling`, for a forecast from its curve)",
                e,
            )
    for curve in curves:
        problem = mismatch(curve, run_key)
        if problem:
            raise Refused(problem)
    return curves
