#!/usr/bin/env bash
# Fetch, on the session's machine, the wheels a bare GPU machine lacks into .whl/ (ignored by git; the device
# call carries it). The versions are the ones that ran there on 2026-11-26 (Python 3.12, torch 2.11.0+cu130).
# Usage: bash experiments/gpu/wheels.sh [PYTHON]
set -euo pipefail
PY=${1:-python3}
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl hydra-core==1.3.2 omegaconf==2.3.0 liger-kernel==0.8.5 torchao==0.17.0
# antlr4's runtime (hydra's parser) is published as a source distribution only: build its pure-Python wheel.
compgen -G ".whl/antlr4_python3_runtime-4.9.3-*.whl" >/dev/null \
  || "$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -la .whl
