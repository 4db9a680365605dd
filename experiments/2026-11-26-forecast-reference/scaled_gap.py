"""Tried and not kept (2026-11-27): a drift term for the reference map, learnt from the references themselves.

The offset map assumes the gap between a run and its smaller sibling stays what it is at the newest point. On the
ladder (tests/fixtures/ladder37, ~4 tokens per parameter) the gap drifts: every d72/d96 forecast from 30% is too
low. With two smaller shapes A < B the drift of their own gap can scale the target's: forecast = L_B(1) -
gap_BT(f) x gap_AB(1) / gap_AB(f). Prints the worst |error| and RMS at each fraction for both maps, each target
forecast from its two nearest strictly smaller shapes (seed 0 of a shape first).

    python experiments/2026-11-26-forecast-reference/scaled_gap.py [LADDER_DIR]   # default tests/fixtures/ladder37
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from lm.run.references import read_reference

ROOT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "ladder37"
SIZE = {"d32": 24_576, "d52": 64_896, "d72": 186_624, "d96": 442_368}
SIZE |= {"e24": 13_824, "e36": 31_104, "e52": 64_896, "e72": 186_624}  # record_ladder.sh ... 20
FRACTIONS = (0.1, 0.2, 0.3, 0.5, 0.8)


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    paths = sorted(p for p in root.iterdir() if p.suffix == ".json" or (p / "config.yaml").is_file())
    curves = {p.stem: read_reference(p) for p in paths}
    shape = {n: n.split("_")[0] for n in curves}
    errors: dict[str, dict[float, list[tuple[str, float]]]] = {"offset": {}, "scaled gap": {}}
    for name, target in curves.items():
        smaller: list[str] = []
        for n in sorted(curves, key=lambda n: (-SIZE[shape[n]], n)):
            if SIZE[shape[n]] < SIZE[shape[name]] and shape[n] not in {shape[s] for s in smaller}:
                smaller.append(n)
        if not smaller:
            continue
        b = curves[smaller[0]]
        for f in FRACTIONS:
            seen = target.fractions <= f + 1e-9
            f0, loss = float(target.fractions[seen][-1]), float(target.losses[seen][-1])
            errors["offset"].setdefault(f, []).append((name, b.final + loss - b.at(f0) - target.final))
            if len(smaller) >= 2:
                a = curves[smaller[1]]
                drift = (a.final - b.final) / (a.at(f0) - b.at(f0))
                forecast = b.final - (b.at(f0) - loss) * drift
                errors["scaled gap"].setdefault(f, []).append((name, forecast - target.final))
    for method, by_fraction in errors.items():
        print(f"{method}:")
        for f, pairs in by_fraction.items():
            e = np.array([x for _, x in pairs])
            each = ", ".join(f"{n} {x:+.3f}" for n, x in pairs)
            print(f"  {f:.0%}: worst {np.abs(e).max():.3f}, RMS {np.sqrt(np.mean(e**2)):.3f}  ({each})")


if __name__ == "__main__":
    main()
