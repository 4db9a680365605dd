#!/usr/bin/env bash
# The held-out ladder for the reference forecast (issue 37): 4 shapes, each <= 3x the next smaller in
# non-embedding parameters (12 L d^2: 24.6K, 64.9K, 187K, 442K; d 52 has 2 heads, the others 4), all at ~4 tokens per parameter, the same wsd
# schedule shape (warm-up 5%, decay the last 20%), 512 tokens a step, one data order (data.seed=0); validation
# every 5% of the run on 32 windows (what the stopper sees); the largest shape at 3 init seeds (run.seed).
#   bash experiments/2026-11-26-forecast-reference/record_ladder.sh /tmp/ladder37
# Two lanes of one thread each (2 cores); each run ~1-7 min on the 2026-11-26 host.
set -euo pipefail
root=${1:-runs/ladder37}
export OMP_NUM_THREADS=1
one() {  # name layers d_model heads steps seed
  local name=$1 L=$2 d=$3 h=$4 steps=$5 seed=$6 start
  start=$(date +%s)
  timeout 1500 python train.py run.root="$root" run.name="$name" run.resume=false run.seed="$seed" \
    trainer=cpu trainer.enable_progress_bar=false model.n_layer="$L" model.d_model="$d" model.n_head="$h" \
    data.max_bytes=6000000 data.val_fraction=0.1 data.tokenizer_sample_bytes=500000 data.vocab_size=512 \
    data.seq_len=64 data.batch_size=8 data.num_workers=0 data.persistent_workers=false \
    trainer.max_steps="$steps" trainer.val_every_steps=$((steps / 20)) trainer.limit_val_batches=32 \
    trainer.log_every_n_steps=10 optim.lr=1e-3 optim.schedule=wsd optim.warmup_steps=$((steps / 20)) \
    optim.decay_fraction=0.2 checkpoint.every_n_steps=100000 cost.price_per_hour=1.0 sampling=off evals=off \
    early_stopping=off > "$root.$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s"
}
mkdir -p "$root"
python -m lm.cli prepare trainer=cpu data.max_bytes=6000000 data.val_fraction=0.1 data.tokenizer_sample_bytes=500000 \
  data.vocab_size=512 data.seq_len=64 > "$root.prepare.log" 2>&1  # once, before two lanes want it
( one d96_s0 4 96 4 3460 0; one d32 2 32 4 200 0; one d52 2 52 2 500 0; one d72 3 72 4 1460 0 ) &
( one d96_s1 4 96 4 3460 1; one d96_s2 4 96 4 3460 2 ) &
wait
