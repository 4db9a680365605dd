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

import types
from typing import Any

import torch

from lm.base.findings import Finding
from lm.base.private_api import MUON_QUINTIC, muon_adjust_lr, muon_tensors, newton_schulz
from lm.config import OptimConfig
from lm.engine import muon_sharded
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
        # torch's own default triple for quintic (what its Muon fills in), so a resume can switch either way.
        "ns_coefficients": QUINTIC if cfg.ns_coefficients == "quintic" else cfg.ns_coefficients,
        "adjust_lr_fn": cfg.adjust_lr,
    }
    return [muon, *({**g, "kind": "adamw"} for g in groups)]


def muon_flops_per_step(model_cfg: ModelConfig, cfg: OptimConfig) -> float:
    """FLOPs of Muon's Newton-Schulz orthogonalisation in one optimizer step (0 for AdamW): per m x n matrix
    (m <= n) and iteration, X X^T (2 m^2 n), the quintic's A @ A (2 m^3) and B @ X (2 m^2 n): the same for
    either `ns_coefficients` (Polar Express changes the numbers, not the matmuls), so `ns_steps` sets the cost.
    A cost per step, not per token: divided by the tokens of a step it is what Muon adds to the model's FLOPs
    per token."""
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
        f"{cfg.adjust_lr}; {cfg.ns_steps} Newton-Schulz steps, {cfg.ns_coefficients}), AdamW on {len(matrices)} embedding/head "
        f"matrices ({sum(matrices) / 1e6:.2f}M) and {len(gains)} norm gains"
    )


def build(model: torch.nn.Module, cfg: OptimConfig, fused: bool) -> torch.optim.Optimizer:
    """The run's optimizer over `model`'s trainable parameters."""
    settings = group_settings(cfg, fused)
    groups = [{"params": ps, **s} for ps, s in zip(split_params(model, cfg), settings, strict=True)]
    if cfg.name == "adamw":
        # The constructor's `fused` is what the checks and guards read (`optimizer.defaults`).
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=cfg.lr, fused=fused)
    else:
        optimizer = MuonWithAdamW(groups)
    if cfg.cautious_weight_decay:
        cautious_decay(optimizer)
    return optimizer


def cautious_decay(optimizer: torch.optim.Optimizer) -> None:
    """Make `optimizer`'s decoupled weight decay cautious (`optim.cautious_weight_decay`): x <- x - lr·u -
    lr·wd·[u·x >= 0]·x, coordinate by coordinate, where u is the step's own update (Chen et al. 2025).

    Any optimizer, fused kernels included: the step runs the closure (Lightning's forward and backward) first,
    then keeps the decayed parameters as they were and steps with each decayed group's `weight_decay` at 0;
    the update is read off the change (x - x' = lr·u) and the decay applied where it has the parameter's
    sign. The decay is torch's (lr·wd·x of the weights before the step), masked. A step that updates nothing
    decays nothing, as torch's: parameters without a gradient (the non-finite guard drops them) and a fused
    step its `found_inf` verdict skipped.

    Costs one copy of the decayed parameters that have a gradient, held during the optimizer step only: taken
    after the closure, when the activations of the backward pass are freed, never beside them at the step's
    peak (what `lm.numbers.memory` and `activation_checkpointing=auto`'s trial measure). `weight_decay` is
    restored in a `finally`, so an exception inside the step (an out-of-memory error a caller catches) leaves
    the configured value for the state dict, the LR schedule and the next step. The step is wrapped on the
    instance, as torch's LR schedulers wrap it, because a step hook runs before the closure and cannot see
    the step fail."""
    torch_step = type(optimizer).step  # torch's own step, its hooks included

    def step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        decayed = [(group, group["weight_decay"]) for group in self.param_groups if group["weight_decay"]]
        olds = [[p.detach().clone() if p.grad is not None else None for p in g["params"]] for g, _ in decayed]
        try:
            for group, _ in decayed:
                group["weight_decay"] = 0.0
            torch_step(self)
        finally:
            for group, decay in decayed:
                group["weight_decay"] = decay
        skipped = getattr(self, "found_inf", None)  # the guards' verdict for a fused step (1.0: skipped)
        with torch.no_grad():
            for (group, decay), before in zip(decayed, olds, strict=True):
                for p, old in zip(group["params"], before, strict=True):
                    if old is None or p.grad is None:
                        continue
                    keep = (old - p).mul_(old) >= 0  # lr·u·x >= 0: the update has the parameter's sign
                    masked = old.mul_(keep) if skipped is None else old.mul_(keep).mul_(1 - skipped)
                    p.sub_(masked, alpha=group["lr"] * decay)
        return loss

    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the groups tagged `kind: muon`, AdamW for those tagged `kind: adamw`, as one optimizer.

    The groups and the state live here (so `state_dict`, `load_state_dict` and `LambdaLR` work unchanged); at
    each step the inner `torch.optim.Muon` and `AdamW` are pointed at their groups and at this state, which
    `load_state_dict` replaces. A parameter without a gradient is skipped by both, as the guards expect.
    Under FSDP2 (DTensor shards) the Muon groups take `lm.engine.muon_sharded.step` instead of torch's
    `Muon`: the same update, each matrix orthogonalised once, on the rank that owns it.
    """

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        kinds = {g["kind"] for g in groups}
        if not kinds <= {"muon", "adamw"}:
            raise ValueError(f"unknown group kinds {sorted(kinds - {'muon', 'adamw'})}")
        # The inner optimizers fill each group's defaults (nesterov, amsgrad, foreach...) in place; both Muons
        # see every Muon group (same defaults) and `step` hands each the groups of its polynomial.
        self.muon = torch.optim.Muon([g for g in groups if g["kind"] == "muon"])
        self.polar = PolarExpressMuon([g for g in groups if g["kind"] == "muon"])
        fused = any(g.get("fused") for g in groups if g["kind"] == "adamw")
        self.adamw = torch.optim.AdamW([g for g in groups if g["kind"] == "adamw"], fused=fused)
        super().__init__(groups, defaults={})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = [g for g in self.param_groups if g["kind"] == "muon"]
        if any(muon_sharded.is_sharded(p) for g in muon for p in g["params"]):
            # FSDP2: each matrix orthogonalised once, by its owner rank (lm.engine.muon_sharded)
            muon_sharded.step(muon, self.state, orthogonalise)
            muon = []
        for inner, groups in (
            (self.muon, [g for g in muon if g["ns_coefficients"] != "polar_express"]),
            (self.polar, [g for g in muon if g["ns_coefficients"] == "polar_express"]),
            (self.adamw, [g for g in self.param_groups if g["kind"] == "adamw"]),
        ):
            inner.param_groups = groups
            inner.state = self.state
            inner.step()
        return loss


QUINTIC = MUON_QUINTIC
"""torch's Muon triple (3.4445, -4.775, 2.0315), the same at every iteration: its default `ns_coefficients`."""

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932), as modded-nanogpt's record runs it
# (github.com/KellerJordan/modded-nanogpt, train_gpt.py, `polar_express_coeffs` and `polar_express`): the
# paper code's optimal_composition(l=1e-3, num_iters=5, safety_factor_eps=2e-2, cushion=0.02)
# (github.com/NoahAmsel/PolarExpress, polar_express.py; recomputed for this file, equal to 1e-14). Each step
# is the optimal odd quintic for the singular-value interval the previous ones left, so the first k triples are
# the optimal k-step method (the paper proves the greedy choice optimal) up to the 2% safety factor
# the k-th keeps; fewer steps take a prefix, as modded-nanogpt and nanochat do.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(grad: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """The update orthogonalised by `steps` Polar Express iterations, in bf16 like torch's Newton-Schulz.

    The polynomials assume singular values in [1e-3, 1]: the Frobenius norm bounds the spectral one, and
    modded-nanogpt's 2% safety margin covers bf16's rounding of it (torch's quintic divides by the norm alone).
    """
    x = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        x = x.T  # (m, n) with m <= n: the Gram matrix is the small one
    x = x / (x.norm() * (1 + 2e-2) + eps)
    for a, b, c in POLAR_EXPRESS[:steps]:
        gram = x @ x.T  # (m, m)
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b A + c A²) x
    return x.T if grad.size(0) > grad.size(1) else x


def orthogonalise(update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """A Muon group's orthogonalisation of one whole matrix: torch's Newton-Schulz with the group's triple, or
    Polar Express (what the single-process step applies, for the sharded step to apply the same)."""
    if group["ns_coefficients"] == "polar_express":
        return polar_express(update, group["ns_steps"], group["eps"])
    return newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])


class PolarExpressMuon(torch.optim.Muon):
    """torch's Muon with `polar_express` in place of its fixed-triple Newton-Schulz; the rest is torch's
    `_single_tensor_muon` line for line (its momentum buffer, Nesterov, decoupled decay, `_adjust_lr`)."""

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # MuonWithAdamW evaluates the closure
        for group in self.param_groups:
            params, grads, bufs = muon_tensors(self, group)
            lr, momentum = group["lr"], group["momentum"]
            for param, grad, buf in zip(params, grads, bufs, strict=True):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = polar_express(update, group["ns_steps"], group["eps"])
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-muon_adjust_lr(lr, group["adjust_lr_fn"], param.shape))


def optimizer_findings(model_cfg: ModelConfig, cfg: OptimConfig) -> list[Finding]:
    """`optim=muon`: which parameters Muon takes and its LR convention, so a surprise (a head left to Muon, a
    Keller-scale LR under Moonlight's scale) shows before the run. AdamW alone needs no line."""
    if cfg.name == "adamw":
        return []
    return [Finding("optimizer", "ok", describe(model_cfg, cfg))]
