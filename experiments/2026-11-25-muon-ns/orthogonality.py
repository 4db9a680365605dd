"""How close to orthogonal Muon's update comes under each Newton-Schulz polynomial and step count, and what
each step count costs at the 1B plan.

For each matrix shape Muon sees (the ladder's d_model 48/80/128 and plan_1b's 2048), a Gaussian matrix and a
momentum-like one (a few strong directions plus a noise tail), orthogonalised by torch's quintic and by Polar
Express at 5/4/3/2 steps: max and mean |singular value - 1| of the bf16 result, in float64.

    PYTHONPATH=src python experiments/2026-11-25-muon-ns/orthogonality.py            # ladder + 1B shapes
    PYTHONPATH=src python experiments/2026-11-25-muon-ns/orthogonality.py --no-1b    # ladder only (seconds)

The ladder shapes run lm's own orthogonalisers (torch's `_zeropower_via_newtonschulz`, lm's `polar_express`).
On a CPU, bf16 matmuls of plan_1b's 2048 x 5632 take ~20 s each, so the 1B shapes run the same polynomials
with float32 matmuls rounded to bf16 after every product (what a bf16 matmul with float32 accumulation stores;
`check_emulation` prints how far it lands from lm's code on a ladder shape), one 5-step pass whose prefixes are
the 4/3/2-step results, and singular values from the float64 Gram matrix's eigenvalues (svdvals of a
2048 x 5632 float64 matrix takes ~2.5 min here).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from lm.config import OptimConfig, compose, to_objects
from lm.engine import optim
from lm.model import ModelConfig, Transformer
from lm.numbers import cost, run_plan

STEPS = (5, 4, 3, 2)
METHODS = {"quintic": [optim.QUINTIC] * 5, "polar_express": list(optim.POLAR_EXPRESS)}
EPS = 1e-7  # torch Muon's default eps


def muon_shapes(model: ModelConfig) -> list[tuple[int, int]]:
    """The distinct block-matrix shapes Muon orthogonalises, a transpose counted once (same spectrum)."""
    with torch.device("meta"):
        params = optim.split_params(Transformer(model), OptimConfig(name="muon"))[0]
    return sorted({tuple(sorted(p.shape)) for p in params})


def gaussian(m: int, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(m, n, generator=gen)


def momentum_like(m: int, n: int, gen: torch.Generator, rank: int = 8, noise: float = 0.2) -> torch.Tensor:
    """A momentum buffer's typical spectrum: `rank` strong directions (weights 1 down to 0.1) plus a
    Gaussian tail holding `noise` of the Frobenius norm: low effective rank, a long thin bulk."""
    u = torch.linalg.qr(torch.randn(m, rank, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(n, rank, generator=gen))[0]
    low = u @ torch.diag(torch.logspace(0, -1, rank)) @ v.T
    tail = torch.randn(m, n, generator=gen)
    return low / low.norm() + noise * tail / tail.norm()


def errors(sv: torch.Tensor) -> tuple[float, float]:
    dev = (sv - 1).abs()
    return dev.max().item(), dev.mean().item()


def orthogonalise(g: torch.Tensor, method: str, steps: int) -> torch.Tensor:
    """lm's code path: torch's Newton-Schulz for quintic, lm's polar_express."""
    if method == "quintic":
        return _zeropower_via_newtonschulz(g, optim.QUINTIC, steps, EPS)
    return optim.polar_express(g, steps, EPS)


def emulated_prefixes(g: torch.Tensor, method: str) -> dict[int, torch.Tensor]:
    """The same iteration with float32 matmuls rounded to bf16 (X wide), every step's result kept."""
    x = g.bfloat16()
    x = x.T if g.size(0) > g.size(1) else x
    # The normalisations exactly as lm's code runs them (in bf16).
    x = x / x.norm().clamp(min=EPS) if method == "quintic" else x / (x.norm() * (1 + 2e-2) + EPS)
    out = {}
    for k, (a, b, c) in enumerate(METHODS[method], start=1):
        f = x.float()
        gram = (f @ f.T).bfloat16().float()
        poly = (b * gram + c * (gram @ gram)).bfloat16().float()
        x = (a * f + poly @ f).bfloat16()
        out[k] = x
    return out


def gram_singular_values(x: torch.Tensor) -> torch.Tensor:
    """Singular values of a wide x from its float64 Gram matrix (m x m)."""
    x = x.double()
    return torch.linalg.eigvalsh(x @ x.T).clamp(min=0).sqrt()


def check_emulation(shape: tuple[int, int]) -> float:
    """Largest gap between the emulation's and lm's singular values on one shape, every method and step."""
    g = gaussian(*shape, torch.Generator().manual_seed(0))
    gap = 0.0
    for method in METHODS:
        emulated = emulated_prefixes(g, method)
        for k in STEPS:
            exact = torch.linalg.svdvals(orthogonalise(g, method, k).double())
            gap = max(gap, (gram_singular_values(emulated[k]).flip(0) - exact).abs().max().item())
    return gap


def flops_share(steps: int) -> float:
    """Muon's FLOPs per token at plan_1b as a share of the model's, with `steps` iterations."""
    cfg = to_objects(compose(["+experiment=plan_1b", "optim=muon", f"optim.ns_steps={steps}"]))
    plan = run_plan.resolve(cfg.data, cfg.trainer, cfg.optim, world=1)
    per_token = optim.muon_flops_per_step(cfg.model, cfg.optim) / plan.tokens_per_step
    return per_token / cost.flops_per_token(cfg.model, cfg.data.seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-1b", action="store_true", help="skip plan_1b's shapes (minutes on a CPU)")
    args = parser.parse_args()
    torch.manual_seed(0)
    ladder = sorted(
        {s for d in (48, 80, 128) for s in muon_shapes(ModelConfig(d_model=d, n_head=4, n_layer=2))}
    )
    big = [] if args.no_1b else muon_shapes(to_objects(compose(["+experiment=plan_1b"])).model)
    header = [f"{m} {k}" for m in METHODS for k in STEPS]
    print("| shape | matrix | " + " | ".join(header) + " |")
    print("|---|---|" + "---|" * len(header))
    for shape in [*ladder, *big]:
        for kind, make in (("gaussian", gaussian), ("momentum-like", momentum_like)):
            g = make(*shape, torch.Generator().manual_seed(0))
            cells = []
            for method in METHODS:
                if shape in big:
                    prefixes = emulated_prefixes(g, method)
                    svs = {k: gram_singular_values(prefixes[k]) for k in STEPS}
                else:
                    svs = {k: torch.linalg.svdvals(orthogonalise(g, method, k).double()) for k in STEPS}
                cells += ["{:.3f} / {:.3f}".format(*errors(svs[k])) for k in STEPS]
            print(f"| {shape[0]} x {shape[1]} | {kind} | " + " | ".join(cells) + " |", flush=True)
    print("\ncells: max |sigma - 1| / mean |sigma - 1|")
    if big:
        print(
            f"emulation check (128 x 512): max singular-value gap to lm's code {check_emulation((128, 512)):.4f}"
        )
    print("\n| ns_steps | Muon FLOPs per token at plan_1b, share of the model's |\n|---|---|")
    for k in STEPS:
        print(f"| {k} | {flops_share(k):.2%} |")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"\n({time.time() - t0:.0f} s)")
