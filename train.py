"""Train a model:  python train.py [+experiment=NAME] [group=option ...] [key=value ...]

Hydra composes conf/train.yaml with the overrides; lm.train.main does the rest.
"""

import sys

import hydra
from omegaconf import DictConfig

from lm.config import register_configs
from lm.exits import JobFailed, exit_code
from lm.rundir import in_multirun
from lm.train import main as train

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        return train(cfg)
    except (ValueError, OSError, SystemExit) as e:
        code = exit_code(e)
        if code is None:
            raise  # a crash (exit 1) or a rollback (75): `lm supervise` restarts; a sweep stops
        fail(e, code)


def fail(error: BaseException, code: int) -> None:
    """Exit with `code`; in a multirun, fail only this job so the sweep goes on (lm.sweep.SweepSummary)."""
    if in_multirun():
        raise JobFailed(str(error), code) from error
    print(f"train.py: {error}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # Hydra reports an error of its own (its config writer on a full disk) as exit 1
        sys.exit(exit_code(e) or e.code)
