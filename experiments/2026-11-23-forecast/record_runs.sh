#!/usr/bin/env bash
# Record the loss curves the schedule-aware forecast benchmark replays: the 2-layer test model (tests/conftest.py
# TINY) on the bundled stdlib corpus (first 6 MB, 10% of the documents held out), training loss logged every 10
# steps, a checkpoint kept every 100 steps. The in-run validation is light (32 batches); extract_curves.py then
# evaluates every checkpoint on 480 batches (3,840 windows: one evaluation's noise < 0.01), which on this shared
# 2-core box is several times cheaper than doing it inside Lightning's loop. Each argument is schedule:steps.
#   bash experiments/2026-11-23-forecast/record_runs.sh /tmp/forecast23 wsd:2000 cosine:2000 wsd:1000 constant:2000 wsd:4000
set -euo pipefail
export OMP_NUM_THREADS=1  # one thread: on a shared, oversubscribed box more threads only thrash
root=${1:-runs/forecast23}
shift || true
items=("$@")
[ ${#items[@]} -gt 0 ] || items=(wsd:2000 cosine:2000)
for item in "${items[@]}"; do
  schedule=${item%%:*}
  steps=${item##*:}
  python train.py run.root="$root" run.name="tiny_${schedule}_${steps}" run.resume=false \
    trainer=cpu trainer.enable_progress_bar=false model.n_layer=2 model.d_model=64 model.n_head=4 \
    data.max_bytes=6000000 data.val_fraction=0.1 data.tokenizer_sample_bytes=500000 data.vocab_size=512 \
    data.seq_len=64 data.batch_size=8 data.num_workers=0 data.persistent_workers=false trainer.max_steps="$steps" trainer.val_every_steps=100 checkpoint.keep_last=-1 \
    trainer.limit_val_batches=32 trainer.log_every_n_steps=10 optim.schedule="$schedule" optim.warmup_steps=50 \
    optim.decay_fraction=0.2 cost.price_per_hour=1.0 sampling=off callbacks={}
done
