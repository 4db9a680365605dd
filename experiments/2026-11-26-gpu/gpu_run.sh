#!/usr/bin/env bash
# One device call (2026-11-26): lm on the lent GPU with its own torch (hydra, omegaconf, antlr, Liger and
# torchao carried as wheels in .whl/). Parts run in priority order under one deadline; each part's output is in
# $OUT/gpu.log and the runs' small files in $OUT/runs.tgz. Usage: bash gpu_run.sh [DEADLINE_S]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${1:-580} ))
HERE=experiments/2026-11-26-gpu
exec > >(tee -a "$OUT/gpu.log") 2>&1
left() { local l=$(( DEADLINE - $(date +%s) )); (( l < 5 )) && l=5; (( l < $1 )) && echo "$l" || echo "$1"; }
part() { echo "=== $1 $(date -u +%H:%M:%S) ($(( DEADLINE - $(date +%s) )) s left)"; }

part setup
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 LM_CACHE=/tmp/lm-cache TOKENIZERS_PARALLELISM=true
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
python3 -c "import torch, lightning, hydra, liger_kernel, torchao, triton, lm.cli; print('torch', torch.__version__, 'lightning', lightning.__version__, 'hydra', hydra.__version__, 'torchao', torchao.__version__, 'triton', triton.__version__, 'cpus', __import__('os').cpu_count())" || exit 1
RUNS=/tmp/runs
BASE=(+experiment=plan_1b evals=off sampling=off early_stopping=off trainer.accumulate_grad_batches=1
  data.num_workers=4 checkpoint.every_n_steps=100000 optim.warmup_steps=15 trainer.log_every_n_steps=5
  trainer.enable_progress_bar=false run.root=$RUNS)
timeout "$(left 120)" python3 -m lm.cli prepare "${BASE[@]}" 2>&1 | tail -3 || exit 1

train() {  # name, max_steps, overrides...: a run whose checkpoints are deleted after (12.7 GB each)
  local name=$1 steps=$2; shift 2
  part "train $name ($steps steps)"
  local t0=$(date +%s)
  timeout "$(left 240)" python3 train.py "${BASE[@]}" run.name="$name" trainer.max_steps="$steps" \
    optim.total_steps="$steps" "$@" > "$RUNS.$name.log" 2>&1
  echo "exit $? after $(( $(date +%s) - t0 )) s"; tail -4 "$RUNS.$name.log"
  rm -rf "$RUNS/$name/checkpoints"
}
# FP8 against bf16, both compiled: tokens/s (>= 1.15x?) and the loss over 150 steps of 8 x 2048 tokens.
train bf16 150 precision=bf16 trainer.val_every_steps=50 trainer.limit_val_batches=16
train fp8 150 precision=fp8 trainer.val_every_steps=50 trainer.limit_val_batches=16
# Muon's and QK-norm's step time against the bf16 AdamW run (same config, median of steps >= 20).
train muon 40 optim=muon trainer.val_every_steps=1000 trainer.limit_val_batches=1
train qknorm 40 model.qk_norm=true trainer.val_every_steps=1000 trainer.limit_val_batches=1
part summarize
python3 $HERE/summarize.py $RUNS "$OUT/summary.json" --skip 20

part "selftest plan_1b"
t0=$(date +%s)
timeout "$(left 260)" python3 -m lm.cli selftest +experiment=plan_1b evals=off 2>&1 | tee "$OUT/selftest.txt" | tail -25
echo "selftest exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"

part "gpu tests: Liger with QK-norm, flex document masking"
timeout "$(left 200)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_knobs_gpu.py \
  tests/model/test_doc_mask.py -k "liger or flex" 2>&1 | tail -15
tar czf "$OUT/runs.tgz" --exclude=checkpoints -C /tmp runs $(cd /tmp && ls runs.*.log) 2>/dev/null
part done
