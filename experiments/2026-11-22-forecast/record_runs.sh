#!/usr/bin/env bash
# Record the validation-loss curves the forecast benchmark replays: the 2-layer test model (tests/conftest.py
# TINY) on the bundled stdlib corpus: 400 steps validated every 10 under a constant and a wsd LR, then a
# longer constant-LR run of 2,000 steps validated every 25.
#   bash experiments/2026-11-22-forecast/record_runs.sh /tmp/forecast-runs
set -euo pipefail
root=${1:-runs/forecast-bench}
for schedule in constant wsd; do
  python train.py run.root="$root" run.name="tiny_$schedule" run.resume=false \
    trainer=cpu trainer.enable_progress_bar=false model.n_layer=2 model.d_model=64 model.n_head=4 \
    data.max_bytes=1500000 data.tokenizer_sample_bytes=500000 data.vocab_size=512 data.seq_len=64 \
    data.batch_size=8 trainer.max_steps=400 trainer.val_every_steps=10 trainer.limit_val_batches=8 \
    optim.schedule="$schedule" optim.warmup_steps=20 cost.price_per_hour=1.0 sampling=off
done
python train.py run.root="$root" run.name=tiny_constant_2k run.resume=false \
  trainer=cpu trainer.enable_progress_bar=false model.n_layer=2 model.d_model=64 model.n_head=4 \
  data.max_bytes=1500000 data.tokenizer_sample_bytes=500000 data.vocab_size=512 data.seq_len=64 \
  data.batch_size=8 trainer.max_steps=2000 trainer.val_every_steps=25 trainer.limit_val_batches=8 \
  optim.schedule=constant optim.warmup_steps=20 cost.price_per_hour=1.0 sampling=code
