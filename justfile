# The commands a user types. `just --list` shows them.

python := env_var_or_default("PYTHON", ".venv/bin/python")

# Create .venv and install lm with its dev tools from requirements.lock: every package pinned, every file
# checked against its sha256 (torch is the CPU wheel). lm itself goes in editable, without touching the rest.
setup:
    test -x {{python}} || python3 -m venv .venv
    {{python}} -m pip install -q --require-hashes -r requirements.lock
    {{python}} -m pip install -q --no-deps --no-build-isolation -e .

# On a GPU box: the CUDA build of the locked torch version first (PyPI's Linux wheel; pass an index for
# another CUDA, e.g. just setup-gpu --index-url https://download.pytorch.org/whl/cu130), then the same lock,
# which keeps that torch, then Liger Kernel and torchao (the gpu extra, outside the lock).
setup-gpu *torch_index:
    test -x {{python}} || python3 -m venv .venv
    {{python}} -m pip install -q "torch==$(sed -n 's/^torch==\([0-9.]*\).*/\1/p' requirements.lock)" {{torch_index}}
    {{python}} -m pip install -q --require-hashes -r requirements.lock
    {{python}} -m pip install -q --no-deps --no-build-isolation -e .
    {{python}} -m pip install -q "liger-kernel>=0.8" "torchao>=0.14"

# Recompile requirements.lock from pyproject.toml (pip-tools in its own .venv-lock/, .venv untouched): pins
# that still fit are kept, torch held at the CPU wheel's version, sha256 for every file, pyproject.toml's digest
# stamped in the header (CI fails on a lock that does not match). `just lock --upgrade`: the newest allowed.
lock *args:
    test -x .venv-lock/bin/pip-compile || (python3 -m venv .venv-lock && .venv-lock/bin/pip install -q "pip-tools==7.6.2")
    .venv-lock/bin/pip-compile -q --generate-hashes --allow-unsafe --no-strip-extras --extra dev --build-deps-for editable \
        --no-emit-index-url --no-emit-find-links -P torch==2.13.0 -o requirements.lock {{args}} pyproject.toml
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
