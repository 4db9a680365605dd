"""Kernels: Liger Kernel's Triton RMSNorm, SwiGLU and RoPE in place of the eager ones, and which SDPA backends
PyTorch may pick.

`check_liger` refuses `kernels.liger=true` where Liger cannot run, before any data is prepared, and
`check_liger_model` a model its kernels cannot serve (a recipe lever they do not compute); `apply_liger`
rebinds the model's forwards (same parameters and state-dict keys); `sdpa_backends` is for the run's log.
`torch.compile` needs no code here: `LMModule.configure_model` compiles in place.
"""

from __future__ import annotations

import importlib
import math
import types
from collections.abc import Callable

import torch

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.model import Attention, ModelConfig, RMSNorm, SwiGLU, Transformer

LIGER_FIX = "use kernels=eager or kernels=compile"


def check_liger(liger: bool, cuda: bool) -> None:
    """Refuse `kernels.liger=true` where Liger cannot run, before any data preparation or model build."""
    if not liger:
        return
    if not cuda:
        raise Refused(
            "kernels.liger=true needs a CUDA GPU: Liger Kernel is written in Triton, which does not run on "
            f"a CPU; {LIGER_FIX}"
        )
    try:
        importlib.import_module("liger_kernel.transformers.functional")
    except ImportError as e:  # not installed, or triton missing/broken underneath it
        raise Refused(
            f"kernels.liger=true but liger_kernel cannot be imported ({e}); install it with "
            f"pip install -e '.[gpu]' (it brings triton), or {LIGER_FIX}"
        ) from e


def check_liger_model(model: ModelConfig) -> None:
    """Refuse `kernels.liger=true` with a model lever Liger's kernels would silently compute wrongly or drop:
    its SwiGLU kernel is SiLU-gated, and its fused linear + cross-entropy never makes the logits that
    `model.logit_softcap` caps and `model.z_loss` reads. A ValueError: exit 78, naming the combination."""
    refused = []
    if model.mlp != "swiglu":
        refused.append(f"model.mlp={model.mlp} (Liger's MLP kernel is SwiGLU)")
    if model.logit_softcap is not None:
        refused.append(
            f"model.logit_softcap={model.logit_softcap} (Liger's fused loss never makes the logits it caps)"
        )
    if model.z_loss:
        refused.append(f"model.z_loss={model.z_loss} (Liger's fused loss never makes the logits it reads)")
    if refused:
        raise Refused(f"kernels.liger=true cannot serve {'; '.join(refused)}; {LIGER_FIX}")


def apply_liger(model: Transformer) -> Transformer:
    """Run the model's RMSNorms, SwiGLU MLPs and rotary embeddings on Liger Kernel's Triton kernels.

    Only the instances' forward methods are rebound (as Liger's own model patches do): the modules, their
    parameters and the state-dict keys stay those of the eager model, so checkpoints are interchangeable.
    The fused linear + cross-entropy loss is `lm.engine.module.fused_linear_cross_entropy`.
    """
    lf = importlib.import_module("liger_kernel.transformers.functional")
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = types.MethodType(_liger_rms_norm(lf), module)
        elif isinstance(module, SwiGLU):
            module.forward = types.MethodType(_liger_swiglu(lf), module)
        elif isinstance(module, Attention):
            module.rotate = types.MethodType(_liger_rotate(lf), module)
    model.liger = True
    return model


def _liger_rms_norm(lf) -> Callable:
    def forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        # casting_mode="llama" is the eager RMSNorm's arithmetic: rstd in fp32, cast back, then the gain.
        # Not in place: the in-place backward overwrites the incoming gradient, which autograd may share.
        return lf.liger_rms_norm(x, self.weight, self.eps, offset=0.0, casting_mode="llama", in_place=False)

    return forward


def _liger_swiglu(lf) -> Callable:
    def forward(self: SwiGLU, x: torch.Tensor) -> torch.Tensor:
        return self.w2(lf.liger_swiglu(self.w1(x), self.w3(x)))

    return forward


def _liger_rotate(lf) -> Callable:
    def rotate(self: Attention, q_BHTE, k_BKTE, cos, sin):
        # Liger's kernel reads the tables in the activations' dtype (the eager path rotates in fp32).
        return lf.liger_rope(q_BHTE, k_BKTE, cos.to(q_BHTE.dtype), sin.to(q_BHTE.dtype))

    return rotate


def sdpa_backends() -> dict[str, bool]:
    """Which scaled-dot-product-attention kernels PyTorch may pick on CUDA (flash first when eligible)."""
    b = torch.backends.cuda
    return {
        "flash": b.flash_sdp_enabled(),
        "mem_efficient": b.mem_efficient_sdp_enabled(),
        "cudnn": b.cudnn_sdp_enabled(),
        "math": b.math_sdp_enabled(),
    }


def vocab_findings(model: ModelConfig) -> list[Finding]:
    """An embedding/lm_head width that is not a multiple of 64 (misaligned tensor-core shapes)."""
    if model.padded_vocab_size % 64:
        padded = math.ceil(model.vocab_size / 64) * 64
        return [
            Finding(
                "vocab",
                "warn",
                f"vocabulary width {model.padded_vocab_size} is not a multiple of 64",
                f"est. up to ~25% on the lm_head matmul (nanoGPT 50257 -> 50304); pads to {padded}",
                "model.vocab_multiple=64",
            )
        ]
    return [Finding("vocab", "ok", f"vocabulary padded to {model.padded_vocab_size}")]
