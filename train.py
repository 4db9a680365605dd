"""Train a model:  python train.py [+experiment=NAME] [group=option ...] [key=value ...]

Hydra composes conf/train.yaml with the overrides; lm.train.main does the rest.
"""

import sys

import hydra
from omegaconf import DictConfig

from lm.callbacks.spot import EXIT_CONFIG, EXIT_SAVE_FAILED
from lm.checkpointing import CheckpointSaveError
from lm.config import register_configs
from lm.train import main as train

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        return train(cfg)
    except ValueError as e:  # a refusal that names its fix (config, data, disk): restarting cannot help
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except CheckpointSaveError as e:  # disk full or over quota: a restart would fail at the next save
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(EXIT_SAVE_FAILED)


if __name__ == "__main__":
    main()
