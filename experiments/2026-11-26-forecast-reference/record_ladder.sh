#!/usr/bin/env bash
# The held-out ladder for the reference forecast (issue 37): 4 shapes, each <= 3x the next smaller in
# non-embedding parameters (12 L d^2: 24.6K, 64.9K, 187K, 442K; d 52 has 2 heads, the others 4), all at ~4 tokens per parameter, the same wsd
# schedule shape (warm-up 5%, decay the last 20%), 512 tokens a step, one data order (data.seed=0); validation
# every 5% of the run on 32 windows (what the stopper sees); the largest shape at 3 init seeds (run.seed).
#   bash experiments/2026-11-26-forecast-reference/record_ladder.sh /tmp/ladder37
# Two lanes of one thread each (2 cores); each run ~1-7 min on the 2026-11-26 host.
#
# With a second argument `20` (2026-11-27), the ladder at ~20 tokens per parameter instead: is the gap drift of
# the ladder above a property of scale or of under-training? 4 shapes 2x24, 2x36, 2x52, 3x72 (12 L d^2: 13.8K,
# 31.1K, 64.9K, 187K, <= 2.9x apart; head width 12-26) at 540, 1,220, 2,540, 7,300 steps of 512 tokens, the
# largest at 3 init seeds, three lanes (~13 min on 2 busy cores); ~1/2.4 the sizes above, so ~30 CPU-minutes:
#   bash experiments/2026-11-26-forecast-reference/record_ladder.sh /tmp/ladder20 20
set -euo pipefail
root=${1:-runs/ladder37}
ladder=${2:-4}
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
if [ "$ladder" = 20 ]; then
  ( one e72_s0 3 72 4 7300 0; one e24 2 24 2 540 0; one e36 2 36 2 1220 0 ) &
  ( one e72_s1 3 72 4 7300 1; one e52 2 52 2 2540 0 ) &
  ( one e72_s2 3 72 4 7300 2 ) &
else
  ( one d96_s0 4 96 4 3460 0; one d32 2 32 4 200 0; one d52 2 52 2 500 0; one d72 3 72 4 1460 0 ) &
  ( one d96_s1 4 96 4 3460 1; one d96_s2 4 96 4 3460 2 ) &
fi
wait
