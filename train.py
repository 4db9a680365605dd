"""Train a model:  python train.py [+experiment=NAME] [group=option ...] [key=value ...]

Hydra composes conf/train.yaml with the overrides; lm.run.train.main does the rest.
"""

import os
import shutil
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from lm.base.exits import EXIT_CONFIG, JobFailed, Refused, exit_code, one_line, readable, unwritable
from lm.config import register_configs
from lm.config.loading import refuse_renamed
from lm.run.hydra_checks import INVOCATION
from lm.store.atomic import unwritable_cause, unwritable_fix
from lm.store.rundir import in_multirun

# Hydra prints a compose error (`model.n_layr=3`, `trainer.max_steps=abc`) and exits 1, which `lm supervise`
# retries as a crash; re-raised, it reaches `run` below and exits 78 like every other refusal.
os.environ["HYDRA_FULL_ERROR"] = "1"
register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # Deferred: Lightning and transformers take seconds to import, and a refused config should not wait.
    from lm.run.train import main as train_main

    try:
        return train_main(cfg)
    except (Refused, OSError, SystemExit) as e:
        code = exit_code(e)
        if code is None:
            raise  # a crash (exit 1, with its traceback) or a rollback (75): `lm supervise` restarts
        fail(e, code, cfg)


def fail(error: BaseException, code: int, cfg: DictConfig) -> None:
    """Exit with `code`; in a multirun, fail only this job so the sweep goes on (lm.run.sweep.SweepSummary)."""
    if in_multirun():
        raise JobFailed(one_line(error), code) from error
    if code == EXIT_CONFIG:
        forget_invocation(Path(HydraConfig.get().runtime.output_dir), Path(cfg.run.root) / cfg.run.name)
    # One write that starts on a line of its own: a dying thread (TensorBoard's writer, when the run directory
    # went away) may be printing its traceback at the same moment, and the summary must stay findable.
    sys.stderr.write(f"\ntrain.py: {readable(error)}\n")
    sys.stderr.flush()
    sys.exit(code)


def forget_invocation(out: Path, run_dir: Path) -> None:
    """Leave the run directory of a refused run as it was: remove the folder Hydra made for this invocation
    before the run started (`hydra/<time>/`: its composed config and log), and the folders above it, up to the
    run directory itself, that this leaves empty (a run that never existed leaves nothing behind).

    A `hydra.run.dir` moved outside the run directory is left alone: it may be a folder that is not ours."""
    out, run_dir = out.resolve(), run_dir.resolve()
    if out.parent != run_dir / "hydra":
        return
    shutil.rmtree(out, ignore_errors=True)
    for folder in (out.parent, run_dir):
        try:
            folder.rmdir()  # only when empty
        except OSError:
            return


def raised_by_the_run(error: BaseException) -> bool:
    """Whether `error` came out of the task (`main`), which has classified its own refusals already."""
    return any(
        frame.f_code is main.__wrapped__.__code__ for frame, _ in traceback.walk_tb(error.__traceback__)
    )


def run() -> None:
    """`main`, with what fails before the run starts refused in one paragraph, not a traceback: a config that
    does not compose (Hydra's and OmegaConf's errors) or that `lm.run.hydra_checks.CheckBeforeRun` refuses."""
    try:
        refuse_renamed([a for a in sys.argv[1:] if not a.startswith("-")])
        main()
    except Exception as e:
        if raised_by_the_run(e):
            raise
        code = EXIT_CONFIG if isinstance(e, HydraException | OmegaConfBaseException) else exit_code(e)
        if code is None:
            raise
        if (failed := unwritable(e)) is not None and "output_dir" in INVOCATION:
            print(f"train.py: {unwritable_start(failed)}", file=sys.stderr)
            sys.exit(code)
        causes = [e, *([e.__cause__] if isinstance(e, HydraException) and e.__cause__ else [])]
        what = "; ".join(one_line(c) for c in causes)
        hint = (
            " Fix that override or config file (`python train.py --help` lists the config groups, "
            "`--cfg job` prints the composed config)."
            if isinstance(e, HydraException | OmegaConfBaseException)
            else ""
        )
        print(f"train.py: {what}{hint}", file=sys.stderr)
        sys.exit(code)


def unwritable_start(error: OSError) -> str:
    """Hydra's writes into this invocation's folder met a full or read-only disk: remove what they left (an
    empty `hydra/<time>/`, and a run directory it alone made) and say which path failed and the fix."""
    out, run_dir = INVOCATION["output_dir"], INVOCATION["run_dir"]
    path = Path(os.fsdecode(error.filename)) if error.filename else out
    forget_invocation(out, run_dir)
    return (
        f"writing {path} (Hydra's record of this invocation) failed before the run started: "
        f"{unwritable_cause(error, path)}. Nothing was trained and the run directory is as it was; "
        f"{unwritable_fix(error)} and rerun the same command"
    )


if __name__ == "__main__":
    run()
