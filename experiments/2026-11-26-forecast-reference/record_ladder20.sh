#!/usr/bin/env bash
# The held-out ladder at ~20 tokens per parameter (issue 37; 2026-11-27): is the gap drift of the ~4 tokens per
# parameter ladder (record_ladder.sh) a property of scale or of under-training? 4 shapes, each <= 2.5x the next
# smaller in non-embedding parameters (12 L d^2: 13.8K, 31.1K, 64.9K, 187K; head width 12-26), all at ~20 tokens
# per parameter (540, 1,220, 2,540, 7,300 steps of 512 tokens), the same wsd schedule shape (warm-up 5%, decay the
# last 20%), one data order (data.seed=0); validation every 5% of the run on 32 windows (what the stopper sees);
# the largest shape at 3 init seeds (run.seed). The same shapes are ~1/2.4 the size of record_ladder.sh's, so the
# whole ladder costs ~30 CPU-minutes instead of ~2 hours.
#   bash experiments/2026-11-26-forecast-reference/record_ladder20.sh /tmp/ladder20
set -euo pipefail
root=${1:-runs/ladder20}
export OMP_NUM_THREADS=1
one() {  # name layers d_model heads steps seed
  local name=$1 L=$2 d=$3 h=$4 steps=$5 seed=$6 start
  start=$(date +%s)
  timeout 4000 python train.py run.root="$root" run.name="$name" run.resume=false run.seed="$seed" \
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
( one e72_s0 3 72 4 7300 0; one e24 2 24 2 540 0; one e36 2 36 2 1220 0 ) &
( one e72_s1 3 72 4 7300 1; one e52 2 52 2 2540 0 ) &
( one e72_s2 3 72 4 7300 2 ) &
wait
