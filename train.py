"""Train a model:  python train.py [+experiment=NAME] [group=option ...] [key=value ...]

Hydra composes conf/train.yaml with the overrides; lm.train.main does the rest.
"""

import hydra
from omegaconf import DictConfig

from lm.config import register_configs
from lm.train import main as train

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return train(cfg)


if __name__ == "__main__":
    main()
