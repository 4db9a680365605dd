#!/usr/bin/env bash
# Record more loss curves for the forecast-priors benchmark: the 2026-11-23 method (record_runs.sh there) with a
# model shape added. Each argument is shape:schedule:steps; shape `tiny` is the 2-layer test model (d_model 64,
# 4 heads), `small` is 4 layers, d_model 128, 4 heads; `medium` 6 layers, d_model 192, 6 heads. Same corpus, batch, lr and warm-up as 2026-11-23.
#   bash experiments/2026-11-24-forecast-priors/record_runs.sh /tmp/forecast24 tiny:wsd:1000 small:wsd:2000
set -euo pipefail
export OMP_NUM_THREADS=1  # one thread: on a shared, oversubscribed box more threads only thrash
root=${1:-runs/forecast24}
shift || true
for item in "$@"; do
  IFS=: read -r shape schedule steps <<<"$item"
  case "$shape" in
    tiny) dims="model.n_layer=2 model.d_model=64 model.n_head=4" ;;
    small) dims="model.n_layer=4 model.d_model=128 model.n_head=4" ;;
    medium) dims="model.n_layer=6 model.d_model=192 model.n_head=6" ;;
    *) echo "unknown shape $shape (tiny|small|medium)" >&2; exit 2 ;;
  esac
  name="${shape}_${schedule}_${steps}"
  start=$(date +%s)
  # shellcheck disable=SC2086
  python train.py run.root="$root" run.name="$name" run.resume=false \
    trainer=cpu trainer.enable_progress_bar=false $dims \
    data.max_bytes=6000000 data.val_fraction=0.1 data.tokenizer_sample_bytes=500000 data.vocab_size=512 \
    data.seq_len=64 data.batch_size=8 data.num_workers=0 data.persistent_workers=false trainer.max_steps="$steps" trainer.val_every_steps=100 checkpoint.keep_last=-1 \
    trainer.limit_val_batches=32 trainer.log_every_n_steps=10 optim.schedule="$schedule" optim.warmup_steps=50 \
    optim.decay_fraction=0.2 cost.price_per_hour=1.0 sampling=off callbacks={}
  echo "$name: trained in $(( $(date +%s) - start )) s"
done
