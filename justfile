# The commands a user types. `just --list` shows them.

python := env_var_or_default("PYTHON", ".venv/bin/python")

# Create .venv and install lm with its dev tools from requirements.lock, the README's first command: every
# package pinned, every file checked against its sha256, all from the public index (on Linux, PyPI's torch: the
# CUDA build with its CUDA libraries, which also runs on a CPU). setuptools first, so sdists build with a hashed
# backend; lm itself goes in editable, without touching the rest.
setup:
    test -x {{python}} || python3 -m venv .venv
    {{python}} -m pip install -q --require-hashes -r requirements-build.lock
    {{python}} -m pip install -q --require-hashes --no-build-isolation -r requirements.lock
    {{python}} -m pip install -q --no-deps --no-build-isolation -e .

# On a Linux GPU box: the same hashed lock (PyPI's torch there is the CUDA 13 build; Liger Kernel and torchao are
# in the lock), then a check that torch sees the GPU. Another CUDA build: docs/development.md#installing-and-the-lock.
setup-gpu: setup
    {{python}} -c "import torch; assert torch.cuda.is_available(), f'torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: nvidia-smi shows whether the driver supports that CUDA'; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}: {torch.cuda.get_device_name()}')"

# Recompile requirements.lock from pyproject.toml: uv's universal lock (every platform, CPython 3.10+, the
# public index only, sha256 for every file), pins that still fit kept; pyproject.toml's digest stamped in the
# header (CI fails on a lock that does not match) and requirements-build.lock written from it.
# `just lock --upgrade`: the newest allowed. Then check it per platform: .venv/bin/python .ci/lock_targets.py
lock *args:
    env -u PIP_FIND_LINKS UV_NO_CONFIG=1 {{python}} -m uv pip compile pyproject.toml --extra dev --universal \
        --generate-hashes --python-version 3.10 --index-url https://pypi.org/simple --no-emit-index-url \
        --no-strip-extras --custom-compile-command "just lock" -o requirements.lock {{args}}
    python3 .ci/lock.py stamp

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
