#!/usr/bin/env bash
# One device call: set up lm on the lent GPU machine (its own torch; hydra, omegaconf, antlr and Liger carried
# as wheels in .whl/), then run the requested parts. Usage: bash gpu_run.sh tests|bench-eager|bench-compile ...
# Everything it prints and writes lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 LM_CACHE=/tmp/lm-cache TOKENIZERS_PARALLELISM=true
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
python3 -c "import torch, lightning, hydra, liger_kernel, triton; print('torch', torch.__version__, 'lightning', lightning.__version__, 'hydra', hydra.__version__, 'triton', triton.__version__, 'cpus', __import__('os').cpu_count())"
BENCH=(+experiment=plan_1b trainer.accelerator=auto trainer.accumulate_grad_batches=1 data.num_workers=4
  bench.timeout_s=300)
for part in "$@"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    prepare)  # the 32K tokenizer and shards of the bundled corpus, once (bench workers reuse the cache)
      time timeout 300 python3 -m lm.cli prepare +experiment=plan_1b 2>&1 | tail -5 ;;
    tests)
      timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_knobs_gpu.py tests/test_memory.py \
        tests/test_bench.py tests/test_distributed.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    bench-eager)
      timeout 420 python3 -m lm.cli bench "${BENCH[@]}" kernels=eager,liger activation_checkpointing=off,on \
        bench.warmup_steps=5 bench.steps=20 bench.out_dir="$OUT/bench-eager" 2>&1 | tail -30 ;;
    bench-compile)
      timeout 560 python3 -m lm.cli bench "${BENCH[@]}" kernels=compile,liger_compile activation_checkpointing=off,on \
        bench.warmup_steps=5 bench.steps=20 bench.out_dir="$OUT/bench-compile" 2>&1 | tail -30 ;;
    retest)  # the two GPU tests that failed on the first call, after their fixes
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_distributed.py \
        tests/test_knobs_gpu.py -k "fsdp or auto_measures" 2>&1 | tee "$OUT/gpu_retest.log" | tail -15 ;;
    probe-noise)
      timeout 120 python3 experiments/2026-11-23-gpu/probe_noise.py 2>&1 | tee "$OUT/probe_noise.log" ;;
    bench-auto)  # auto against a micro-batch that does not fit without checkpointing
      timeout 420 python3 -m lm.cli bench "${BENCH[@]}" kernels=compile activation_checkpointing=auto \
        data.batch_size=8,16 bench.warmup_steps=5 bench.steps=20 bench.out_dir="$OUT/bench-auto" 2>&1 | tail -30 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
