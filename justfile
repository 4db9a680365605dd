# The commands a user types. `just --list` shows them.

python := env_var_or_default("PYTHON", ".venv/bin/python")

# Create .venv and install lm with its dev tools (CPU torch wheel first, so pip never pulls a CUDA build here).
setup:
    test -x {{python}} || python3 -m venv .venv
    {{python}} -m pip install -q "torch==2.13.0"
    {{python}} -m pip install -q -e ".[dev]"

# On a GPU box: install with the CUDA torch from the index and Liger Kernel.
setup-gpu:
    test -x {{python}} || python3 -m venv .venv
    {{python}} -m pip install -q -e ".[dev,gpu]"

# Train (defaults: the smoke run). Pass Hydra overrides: just train +experiment=phase1
train *overrides:
    {{python}} train.py {{overrides}}

# Build the tokenizer and token shards without training.
prepare *overrides:
    {{python}} -m lm.cli prepare {{overrides}}

# The test suite (the same command CI runs), on two workers (pytest-xdist).
test *args:
    {{python}} -m pytest -q -n 2 {{args}}

# The whole fault matrix (CI runs only its fast cases), printed as a Markdown table.
faults *args:
    {{python}} tests/run_matrix.py {{args}}

# Lint and format check.
lint:
    {{python}} -m ruff check .
    {{python}} -m ruff format --check .

# Format the code.
fmt:
    {{python}} -m ruff format .
    {{python}} -m ruff check --fix .

# TensorBoard over every run; its Custom Scalars tab opens on the run's story (loss, throughput, MFU).
tb root="runs":
    @echo "open http://localhost:6006/#custom_scalars"
    {{python}} -m tensorboard.main --logdir {{root}}
