"""A CPU stand-in for a ledger item (`ledger.py run --dry-run`): sleeps, then prints a result line marked as a
stand-in. It measures nothing; it exercises the scheduler's time boxes and records.

    python3 experiments/gpu/items/standin.py ID [--sleep SECONDS] [--fail]
"""

import argparse
import json
import time

ap = argparse.ArgumentParser()
ap.add_argument("id")
ap.add_argument("--sleep", type=float, default=0.1)
ap.add_argument("--fail", action="store_true")
a = ap.parse_args()
print(f"stand-in for item {a.id}: sleeping {a.sleep:g} s", flush=True)
time.sleep(a.sleep)
summary = f"STAND-IN for {a.id}: slept {a.sleep:g} s, measured nothing"
print("LEDGER_RESULT " + json.dumps({"summary": summary, "standin": True}), flush=True)
raise SystemExit(1 if a.fail else 0)
