"""Train a model:  python train.py [+experiment=NAME] [group=option ...] [key=value ...]

Hydra composes conf/train.yaml with the overrides; lm.train.main does the rest.
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from lm.callbacks.health import Diverged
from lm.callbacks.spot import EXIT_CONFIG, EXIT_DIVERGED, EXIT_SAVE_FAILED
from lm.checkpointing import CheckpointSaveError
from lm.config import register_configs
from lm.sweep import JobFailed
from lm.train import main as train

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        return train(cfg)
    except ValueError as e:  # a refusal that names its fix (config, data, disk): restarting cannot help
        fail(e, EXIT_CONFIG)
    except CheckpointSaveError as e:  # disk full or over quota: a restart would fail at the next save
        fail(e, EXIT_SAVE_FAILED)
    except Diverged as e:
        if e.code != EXIT_DIVERGED:
            raise  # a rollback (75): the whole sweep stops and `lm supervise` resumes every job
        fail(RuntimeError("diverged again after a rollback (see checkpoints/rollbacks.json)"), EXIT_DIVERGED)


def fail(error: Exception, code: int) -> None:
    """Exit with `code`; in a multirun, fail only this job so the sweep goes on (lm.sweep.SweepSummary)."""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        raise JobFailed(str(error), code) from error
    print(f"train.py: {error}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
