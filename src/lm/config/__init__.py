"""Typed schemas of the config tree, registered with Hydra's ConfigStore, and their composition.

`conf/train.yaml` starts from the `lm_schema` node, so every group file and every override is checked against
these dataclasses at compose time: `model.n_layr=3` or `trainer.max_steps=abc` fails before anything is built.
Third-party objects (extra Lightning callbacks) stay plain `_target_` YAML.

One module per concern: `data` (the corpus or mixture), `training` (how steps are taken), `root` (the run
around its steps, and the root `LMConfig`), `loading` (the config folder, Hydra, `compose`, `to_objects`). Every public
name is re-exported here: `from lm.config import X` is the one spelling the rest of lm uses.
"""

from lm.config.data import ON_EXHAUSTED, SOURCES, VERIFY, DataConfig, MixtureSource
from lm.config.loading import compose, conf_dir, init_tokenizer, register_configs, to_objects
from lm.config.root import (
    PRICINGS,
    BenchConfig,
    CostConfig,
    DoctorConfig,
    EarlyStoppingConfig,
    EvalsConfig,
    GpuConfig,
    LMConfig,
    PhaseConfig,
    PhasesConfig,
    RunConfig,
    SamplingConfig,
)
from lm.config.training import (
    FP8_RECIPES,
    MUON_LR_SCALES,
    NS_COEFFICIENTS,
    OPTIMIZERS,
    POLAR_EXPRESS_STEPS,
    PRECISIONS,
    SCHEDULES,
    ActivationCheckpointingConfig,
    CheckpointConfig,
    GuardConfig,
    KernelsConfig,
    LoggerConfig,
    OptimConfig,
    PrecisionConfig,
    TrainerConfig,
)

__all__ = [
    "FP8_RECIPES", "MUON_LR_SCALES", "NS_COEFFICIENTS", "ON_EXHAUSTED", "OPTIMIZERS", "POLAR_EXPRESS_STEPS", "PRECISIONS", "PRICINGS", "SCHEDULES", "SOURCES", "VERIFY",
    "ActivationCheckpointingConfig", "BenchConfig", "CheckpointConfig", "CostConfig", "DataConfig",
    "DoctorConfig", "EarlyStoppingConfig", "EvalsConfig", "GpuConfig", "GuardConfig", "KernelsConfig", "LMConfig",
    "LoggerConfig", "MixtureSource", "OptimConfig", "PhaseConfig", "PhasesConfig", "PrecisionConfig",
    "RunConfig", "SamplingConfig", "TrainerConfig",
    "compose", "conf_dir", "init_tokenizer", "register_configs", "to_objects",
]  # fmt: skip
