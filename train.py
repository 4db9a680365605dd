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

from lm.config import register_configs
from lm.store.exits import EXIT_CONFIG, JobFailed, exit_code
from lm.store.rundir import in_multirun

# Hydra prints a compose error (`model.n_layr=3`, `trainer.max_steps=abc`) and exits 1, which `lm supervise`
# retries as a crash; re-raised, it reaches `run` below and exits 78 like every other refusal.
os.environ["HYDRA_FULL_ERROR"] = "1"
register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # Deferred: Lightning and transformers take seconds to import, and a refused config should not wait.
    from lm.run.train import main as train

    try:
        return train(cfg)
    except (ValueError, OSError, SystemExit) as e:
        code = exit_code(e)
        if code is None:
            raise  # a crash (exit 1) or a rollback (75): `lm supervise` restarts; a sweep stops
        fail(e, code, cfg)


def fail(error: BaseException, code: int, cfg: DictConfig) -> None:
    """Exit with `code`; in a multirun, fail only this job so the sweep goes on (lm.tools.sweep.SweepSummary)."""
    if in_multirun():
        raise JobFailed(str(error), code) from error
    if code == EXIT_CONFIG:
        forget_invocation(Path(cfg.run.root) / cfg.run.name)
    print(f"train.py: {error}", file=sys.stderr)
    sys.exit(code)


def forget_invocation(run_dir: Path) -> None:
    """Leave the run directory of a refused run as it was: remove the folder Hydra made for this invocation
    before the run started (`hydra/<time>/`: its composed config and log), and the folders above it, up to the
    run directory itself, that this leaves empty (a run that never existed leaves nothing behind).

    A `hydra.run.dir` moved outside the run directory is left alone: it may be a folder that is not ours."""
    out = Path(HydraConfig.get().runtime.output_dir).resolve()
    run_dir = run_dir.resolve()
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
        main()
    except Exception as e:
        if raised_by_the_run(e):
            raise
        code = EXIT_CONFIG if isinstance(e, HydraException | OmegaConfBaseException) else exit_code(e)
        if code is None:
            raise
        causes = [e, *([e.__cause__] if isinstance(e, HydraException) and e.__cause__ else [])]
        what = "; ".join(
            " ".join(line.strip() for line in str(c).splitlines() if line.strip()) for c in causes
        )
        hint = (
            " Fix that override or config file (`python train.py --help` lists the config groups, "
            "`--cfg job` prints the composed config)."
            if isinstance(e, HydraException | OmegaConfBaseException)
            else ""
        )
        print(f"train.py: {what}{hint}", file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    run()
