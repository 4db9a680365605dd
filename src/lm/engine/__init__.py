"""What trains the model: the LightningModule, optimizers, kernels, parallelism, runtime, activation checkpointing."""
