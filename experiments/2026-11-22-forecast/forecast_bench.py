"""How early does the loss forecast predict the final validation loss within 0.02?

Replays real loss curves point by point: after each validation point the power law L(D) = E + B * D^(-beta)
is fitted to the points so far (lm.numbers.forecast.fit_power_law, as the stopper does) and asked for the loss at the
run's final token count. Reports, per curve, the first point from which every later forecast is within 0.02
of the final measured loss.

    python experiments/2026-11-22-forecast/forecast_bench.py /tmp/forecast-runs/tiny_constant /tmp/forecast-runs/tiny_wsd
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from lm.numbers.forecast import fit_power_law
from lm.run.report import load_scalars

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.02

# The seed's 1B run (article 002), 131,072 tokens a step. Steps 1-200 and 7,750 are training losses quoted in
# the text; 10K, 60K and 90K are the phase-end validation losses of its table.
SEED = [
    (1, 10.63),
    (10, 9.58),
    (50, 8.19),
    (200, 6.41),
    (7_750, 3.0),
    (10_000, 2.948),
    (60_000, 2.573),
    (90_000, 2.494),
]
SEED_TOKENS_PER_STEP = 131_072


def replay(
    tokens: np.ndarray,
    losses: np.ndarray,
    min_points: int,
    skip_tokens: float = 0.0,
    final_loss: float | None = None,
) -> list[dict]:
    """Forecast of the final loss after each point: [{i, tokens, predicted, error, fit}].

    `final_loss` is what the forecast is judged against: the last measured point unless given.
    """
    final_tokens = tokens[-1]
    final_loss = losses[-1] if final_loss is None else final_loss
    rows = []
    for i in range(len(tokens)):
        keep = tokens[: i + 1] >= skip_tokens
        fit = fit_power_law(tokens[: i + 1][keep], losses[: i + 1][keep], min_points=min_points)
        if fit is None:
            continue
        predicted = float(fit.loss(final_tokens))
        rows.append(
            {
                "i": i,
                "tokens": float(tokens[i]),
                "fraction_of_run": float(tokens[i] / final_tokens),
                "predicted": predicted,
                "error": predicted - final_loss,
                "E": fit.E,
                "B": fit.B,
                "beta": fit.beta,
            }
        )
    return rows


def settled(rows: list[dict]) -> dict | None:
    """The first forecast from which every later one (before the last point) is within the tolerance."""
    first = None
    for row in rows[:-1]:  # the last point predicts itself
        inside = abs(row["error"]) <= TOLERANCE
        first = (first or row) if inside else None
    return first


def run_curve(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, validation loss) of a recorded run, from its TensorBoard events."""
    scalars = load_scalars(run_dir / "tb")
    val, tokens = scalars["val/loss"], scalars["train/tokens"]
    return tokens.at(val.steps), val.values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="run directories to replay")
    parser.add_argument("--skip-tokens", type=float, default=0.0, help="leave points before this out of fits")
    args = parser.parse_args()

    results = {}
    curves = {
        "seed 1B (article figures)": (
            np.array([s for s, _ in SEED]) * SEED_TOKENS_PER_STEP,
            np.array([v for _, v in SEED]),
        )
    }
    for run in args.runs:
        curves[run.name] = run_curve(run)

    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, (name, (tokens, losses)) in zip(axes[0], curves.items()):
        is_seed = name.startswith("seed")
        variants = {"all points": 0.0}
        if is_seed:
            variants["from step 200"] = 200 * SEED_TOKENS_PER_STEP
        elif args.skip_tokens:
            variants[f"from {args.skip_tokens:,.0f} tokens"] = args.skip_tokens
        else:
            variants["from 10% of the run"] = 0.1 * tokens[-1]
        results[name] = {
            "final_tokens": float(tokens[-1]),
            "final_loss": float(losses[-1]),
            "points": len(tokens),
        }
        targets = {"last point": float(losses[-1])}
        if not is_seed:
            # One evaluation on a small validation set jitters by a few hundredths: judge also against the
            # mean of the last 5 points, a steadier "final loss".
            targets["mean of last 5"] = float(np.mean(losses[-5:]))
        runs = [
            (f"{label}, vs {t}", skip, ref) for label, skip in variants.items() for t, ref in targets.items()
        ]
        for label, skip, reference in runs:
            rows = replay(
                tokens, losses, min_points=3 if is_seed else 5, skip_tokens=skip, final_loss=reference
            )
            first = settled(rows)
            results[name][label] = {"replay": rows, "settled": first}
            ax.plot(
                [r["tokens"] for r in rows],
                [r["predicted"] for r in rows],
                "o-",
                ms=3,
                label=f"forecast ({label})",
            )
            where = (
                f"within {TOLERANCE} from {first['fraction_of_run']:.0%} of the tokens"
                if first
                else f"never within {TOLERANCE} before the end"
            )
            print(f"{name} [{label}]: final {reference:.3f} at {tokens[-1]:.3g} tokens; {where}")
            for r in rows:
                print(
                    f"  after {r['tokens']:.3g} tokens ({r['fraction_of_run']:.0%}): predicted {r['predicted']:.3f} "
                    f"(error {r['error']:+.3f}; E {r['E']:.2f} beta {r['beta']:.3f})"
                )
        ax.plot(tokens, losses, "k.", label="measured")
        ax.axhspan(
            losses[-1] - TOLERANCE, losses[-1] + TOLERANCE, color="C2", alpha=0.2, label="final +-0.02"
        )
        ax.set_xscale("log")
        ax.set_ylim(losses[-1] - 0.5, losses[-1] + 1.5)
        ax.set_xlabel("tokens when the forecast was made")
        ax.set_ylabel("forecast of the final loss")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "forecast.png", dpi=110)
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {HERE / 'forecast.png'} and {HERE / 'results.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
