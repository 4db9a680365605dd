"""What trains and runs the model: the LightningModule, optimizers, kernels, parallelism, runtime, generation, HF, evaluation."""
