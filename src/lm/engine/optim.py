"""The optimizer of a run: AdamW alone (`optim=adamw`), or Muon on the blocks' matrices with AdamW on the rest
(`optim=muon`), always as ONE `torch.optim.Optimizer`.

One object, not two: Lightning's automatic optimization (accumulation, clipping, precision plugins), the one
`LambdaLR`, the checkpoint's `optimizer_states[0]`, `apply_optim_config` and the NaN/spike guards all see a
single optimizer whose param_groups carry every LR. `MuonWithAdamW` keeps torch's own `Muon` and `AdamW` inside
and lends them its groups and state at each step, so the update rules are torch's, not a copy.

LR convention: `adjust_lr="match_rms_adamw"` (Moonlight, "Muon is Scalable for LLM Training", 2025) scales each
matrix's orthogonalised update by 0.2·sqrt(max(rows, cols)), which gives it the RMS of a typical AdamW update.
Muon then shares AdamW's LR scale, weight decay and schedule (`optim.muon_lr: null` means `optim.lr`): one LR
to sweep, and an AdamW run's LR is the right order of magnitude for Muon (experiments/2026-11-23-muon: the
best was ~3x AdamW's on small models). `original` (Keller Jordan's
sqrt(max(1, rows/cols))) needs its own, ~10-50x larger `optim.muon_lr`.
"""

from __future__ import annotations

from typing import Any

import torch

from lm.base.findings import Finding
from lm.config import OptimConfig
from lm.model import ModelConfig, Transformer


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """Muon's share: the 2-D matrices inside the transformer blocks (attention and MLP projections).

    The embedding and the output head are 2-D too, but they are lookup tables and a classifier, not hidden
    linear maps: Muon's orthogonalisation treats all their rows as one operator, which the Muon and Moonlight
    reports found worse than AdamW there. Norm gains (1-D) cannot be orthogonalised at all.
    """
    return name.startswith("blocks.") and p.dim() == 2


def split_params(model: torch.nn.Module, cfg: OptimConfig) -> list[list[torch.Tensor]]:
    """The trainable parameters in the order of `group_settings`' groups."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.name == "adamw":
        return [[p for _, p in named if p.dim() >= 2], [p for _, p in named if p.dim() < 2]]
    return [
        [p for n, p in named if is_muon_param(n, p)],
        [p for n, p in named if not is_muon_param(n, p) and p.dim() >= 2],
        [p for _, p in named if p.dim() < 2],
    ]


def group_settings(cfg: OptimConfig, fused: bool) -> list[dict[str, Any]]:
    """Each group's settings from `optim`: what a fresh run is built with and what a resumed one sets over the
    restored optimizer (`LMModule.apply_optim_config`). Matrices decay; norm gains (and any bias) do not:
    decaying a gain towards 0 only fights the loss."""
    adamw = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, "fused": fused}
    groups = [{**adamw, "weight_decay": cfg.weight_decay}, {**adamw, "weight_decay": 0.0}]
    if cfg.name == "adamw":  # plain AdamW groups, as checkpoints written before optim=muon hold them
        return groups
    muon = {
        "kind": "muon",
        "lr": cfg.muon_lr if cfg.muon_lr is not None else cfg.lr,
        "weight_decay": cfg.muon_weight_decay if cfg.muon_weight_decay is not None else cfg.weight_decay,
        "momentum": cfg.muon_momentum,
        "ns_steps": cfg.ns_steps,
        "adjust_lr_fn": cfg.adjust_lr,
    }
    return [muon, *({**g, "kind": "adamw"} for g in groups)]


def muon_flops_per_step(model_cfg: ModelConfig, cfg: OptimConfig) -> float:
    """FLOPs of Muon's Newton-Schulz orthogonalisation in one optimizer step (0 for AdamW): per m x n matrix
    (m <= n) and iteration, X X^T (2 m^2 n), the quintic's A @ A (2 m^3) and B @ X (2 m^2 n). A cost per step,
    not per token: divided by the tokens of a step it is what Muon adds to the model's FLOPs per token."""
    if cfg.name != "muon":
        return 0.0
    with torch.device("meta"):
        model = Transformer(model_cfg)
    total = 0.0
    for p in split_params(model, cfg)[0]:
        m, n = sorted(p.shape)
        total += cfg.ns_steps * (4.0 * m * m * n + 2.0 * m**3)
    return total


def describe(model_cfg: ModelConfig, cfg: OptimConfig) -> str:
    """Which parameters Muon and AdamW get and under which LR scale: the doctor's line for `optim=muon`.
    Counted on the meta device (no memory, no initialisation)."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    muon, matrices, gains = ([p.numel() for p in g] for g in split_params(model, cfg))
    lr = cfg.muon_lr if cfg.muon_lr is not None else cfg.lr
    scale = (
        "0.2·sqrt(max dim), AdamW's update RMS" if cfg.adjust_lr == "match_rms_adamw" else "sqrt(rows/cols)"
    )
    return (
        f"Muon on {len(muon)} block matrices ({sum(muon) / 1e6:.2f}M parameters; lr {lr:g} x {scale}: "
        f"{cfg.adjust_lr}; {cfg.ns_steps} Newton-Schulz steps), AdamW on {len(matrices)} embedding/head "
        f"matrices ({sum(matrices) / 1e6:.2f}M) and {len(gains)} norm gains"
    )


def build(model: torch.nn.Module, cfg: OptimConfig, fused: bool) -> torch.optim.Optimizer:
    """The run's optimizer over `model`'s trainable parameters."""
    settings = group_settings(cfg, fused)
    groups = [{"params": ps, **s} for ps, s in zip(split_params(model, cfg), settings, strict=True)]
    if cfg.name == "adamw":
        # The constructor's `fused` is what the checks and guards read (`optimizer.defaults`).
        return torch.optim.AdamW(groups, lr=cfg.lr, fused=fused)
    return MuonWithAdamW(groups)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the groups tagged `kind: muon`, AdamW for those tagged `kind: adamw`, as one optimizer.

    The groups and the state live here (so `state_dict`, `load_state_dict` and `LambdaLR` work unchanged); at
    each step the inner `torch.optim.Muon` and `AdamW` are pointed at their groups and at this state, which
    `load_state_dict` replaces. A parameter without a gradient is skipped by both, as the guards expect.
    """

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        kinds = {g["kind"] for g in groups}
        if not kinds <= {"muon", "adamw"}:
            raise ValueError(f"unknown group kinds {sorted(kinds - {'muon', 'adamw'})}")
        # The inner optimizers fill each group's defaults (nesterov, amsgrad, foreach...) in place.
        self.muon = torch.optim.Muon([g for g in groups if g["kind"] == "muon"])
        fused = any(g.get("fused") for g in groups if g["kind"] == "adamw")
        self.adamw = torch.optim.AdamW([g for g in groups if g["kind"] == "adamw"], fused=fused)
        super().__init__(groups, defaults={})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for kind, inner in (("muon", self.muon), ("adamw", self.adamw)):
            inner.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            inner.state = self.state
            inner.step()
        return loss


def optimizer_findings(model_cfg: ModelConfig, cfg: OptimConfig) -> list[Finding]:
    """`optim=muon`: which parameters Muon takes and its LR convention, so a surprise (a head left to Muon, a
    Keller-scale LR under Moonlight's scale) shows before the run. AdamW alone needs no line."""
    if cfg.name == "adamw":
        return []
    return [Finding("optimizer", "ok", describe(model_cfg, cfg))]
