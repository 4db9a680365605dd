#!/usr/bin/env bash
# The GPU ledger's one device call: set up lm on a bare GPU machine, then run the ledger's pending items in
# priority order, each in its time box, all within SECONDS; each result is recorded in experiments/gpu/
# ledger.json as it finishes and mirrored to $OUT (ledger.json, README.md, logs.tgz, run.log), which is what
# comes back. Usage: bash experiments/gpu/run.sh SECONDS   (device tool: carry [".whl"], timeout_s >= SECONDS)
# The machine's own torch is used; hydra-core, omegaconf, antlr4, liger-kernel and torchao travel as wheels
# in .whl/ (experiments/gpu/wheels.sh fetches them here), as experiments/2026-11-26-gpu/gpu_run.sh did.
set -uo pipefail
WINDOW=${1:?usage: bash experiments/gpu/run.sh SECONDS}
START=$(date +%s)
OUT=${OUT:-/tmp/lm-gpu-out}; mkdir -p "$OUT"
HERE=experiments/gpu
exec > >(tee -a "$OUT/run.log") 2>&1
left() { echo $(( WINDOW - ($(date +%s) - START) )); }
echo "=== setup $(date -u +%FT%TZ) ($(left) s left)"

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels did not install"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 LM_CACHE=/tmp/lm-cache TOKENIZERS_PARALLELISM=true
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
python3 -c "import torch, lightning, hydra, omegaconf, lm.cli; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'hydra', hydra.__version__, 'gpu', torch.cuda.get_device_name(0))" \
  || { echo "lm does not import: carry .whl (bash experiments/gpu/wheels.sh on the session's machine first)"; exit 1; }
python3 -c "import liger_kernel, torchao" 2>/dev/null || echo "WARNING: no liger_kernel/torchao: the Liger and FP8 rows will fail"

# The 32K tokenizer and shards of the bundled corpus, once for every item (plan_1b's data).
timeout 150 python3 -m lm.cli prepare +experiment=plan_1b 2>&1 | tail -3
echo "=== ledger $(date -u +%FT%TZ) ($(left) s left)"
python3 $HERE/ledger.py run "$(left)" --mirror "$OUT"
echo "=== done $(date -u +%FT%TZ) ($(left) s left)"
