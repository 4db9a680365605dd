#!/usr/bin/env bash
# CPU seconds (user+system) of a newcomer's first commands, 3 repetitions each, and the median.
# Run from the repository root: experiments/2026-11-24-startup/measure.sh
set -u
PY=${PY:-.venv/bin/python}
measure() {
  local times=()
  for _ in 1 2 3; do
    /usr/bin/time -o /tmp/lm-startup-time -f "%U %S" "$@" >/dev/null 2>&1
    times+=("$(tail -1 /tmp/lm-startup-time | awk '{printf "%.2f", $1 + $2}')")
  done
  median=$(printf '%s\n' "${times[@]}" | sort -n | sed -n 2p)
  printf '%-55s %s  median %s\n' "$*" "${times[*]}" "$median"
}
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
measure "$PY" -m lm.cli --help
measure "$PY" -m lm.cli plan --help
measure "$PY" train.py model.n_layr=3          # unknown key (Hydra)
measure "$PY" train.py trainer.max_steps=abc   # schema-invalid value (OmegaConf)
measure "$PY" train.py data.batch_size=0       # refused by CheckBeforeRun (to_objects)
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
