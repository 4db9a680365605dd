"""`lm sky`: rank the catalog's GPUs by dollars per token for a config and write the SkyPilot task.

$ per 10^9 tokens = $/hour / 3600 / (tokens/s) x 10^9, with tokens/s = peak bf16 FLOP/s x MFU / FLOPs per token
(`lm.numbers.cost.flops_per_token`) and an assumed MFU (0.45 by default: the seed's 1B run measured ~0.6 on an A100
under our FLOPs convention, so 0.45 leaves room for a cloud VM's slower data path). A GPU is a candidate when
the run fits in 90% of its memory by `memory_needed_gb` and SkyPilot has a name for it. The task is a managed
spot job: SkyPilot relaunches it elsewhere after a preemption, and the run resumes from the newest checkpoint
lm uploaded to the bucket (`checkpoint.remote`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lm.config import DataConfig, GpuConfig
from lm.model import ModelConfig
from lm.numbers import cost, memory
from lm.numbers.cost import ASSUMED_MFU
from lm.store.bench_file import measured_mfu

MEMORY_HEADROOM = 0.9  # fragmentation, compile workspaces, the NCCL and CUDA contexts' own appetite

# Catalog entry -> SkyPilot accelerator name (`sky show-gpus -a`). Left out on purpose: `cpu`; `h100_pcie`
# (SkyPilot's `H100` is the SXM part on most clouds, so it would be asked for under the wrong price and
# speed); `rtx_pro_6000` (its SkyPilot name varies by cloud). Add a line here when you catalogue a GPU.
SKY_NAMES = {
    "h100_sxm": "H100",
    "h200": "H200",
    "a100_80gb": "A100-80GB",
    "a100_40gb": "A100",
    "l40s": "L40S",
    "a40": "A40",
    "rtx_a6000": "RTXA6000",
}


@dataclass
class Candidate:
    """One catalogued GPU, priced per token for a config."""

    gpu: GpuConfig
    sky_name: str | None
    price: float | None
    """$/hour per GPU used for the ranking."""
    pricing: str
    """Which price that is: `spot`, or `on_demand` where the catalog has no spot price (an upper bound)."""
    usd_per_billion_tokens: float | None
    need_gb: float
    fits: bool

    @property
    def why_not(self) -> str | None:
        """Why the task does not ask for this GPU, or None when it does."""
        if self.sky_name is None:
            return "no SkyPilot name in lm.tools.sky.SKY_NAMES"
        if not self.gpu.peak_bf16_tflops or self.price is None:
            return "no catalogued bf16 peak or price"
        if not self.fits:
            return f"needs ~{self.need_gb:.0f} GB, has {self.gpu.memory_gb:g}"
        return None


def memory_needed_gb(model: ModelConfig, data: DataConfig, ac_every: int) -> float:
    """Peak training memory of one GPU, GB, in bf16 mixed precision with AdamW: `lm.numbers.memory`'s estimate
    (the doctor's and `lm bench`'s), at the config's micro-batch and activation checkpointing."""
    est = memory.estimate(
        model, batch_size=data.batch_size, seq_len=data.seq_len, precision="bf16-mixed", ac_every=ac_every
    )
    return est.total / 1e9


def rank_gpus(
    model: ModelConfig,
    data: DataConfig,
    ac_every: int,
    catalog: dict[str, GpuConfig],
    pricing: str = "spot",
    mfu: float = ASSUMED_MFU,
    bench_dir: Path | None = None,
) -> list[Candidate]:
    """Every catalogued GPU with its $/10^9 tokens for this model and micro-batch, cheapest first
    (unpriceable ones last). A GPU that `lm bench` measured this model on (bench.json in `bench_dir`) is
    ranked at its measured MFU (an FP8 row's speed included), the others at `mfu`."""
    fpt = cost.flops_per_token(model, data.seq_len)
    need = memory_needed_gb(model, data, ac_every)
    out = []
    for key, gpu in catalog.items():
        if key == "cpu":
            continue
        price, kind = cost.catalog_price(gpu, pricing) or (None, pricing)
        per_b = None
        if price is not None and gpu.peak_bf16_tflops:
            n_params = memory.parameter_count(model)[0]
            ratio = cost.fp8_peak_ratio(gpu)
            measured = measured_mfu(bench_dir, key, model, n_params, ratio) if bench_dir else None
            tokens_per_sec = gpu.peak_bf16_tflops * 1e12 * (measured or mfu) / fpt
            per_b = cost.usd_per_billion_tokens(tokens_per_sec, price, 1)
        fits = gpu.memory_gb is not None and need <= MEMORY_HEADROOM * gpu.memory_gb
        out.append(Candidate(gpu, SKY_NAMES.get(key), price, kind, per_b, need, fits))
    return sorted(out, key=lambda c: (c.usd_per_billion_tokens is None, c.usd_per_billion_tokens or 0.0))


def render_task(overrides: list[str], ranked: list[Candidate], mfu: float = ASSUMED_MFU) -> str:
    """The SkyPilot task YAML (deterministic: the committed file is checked against it)."""
    chosen = [c for c in ranked if c.why_not is None]
    if not chosen:
        raise ValueError(
            "no catalogued GPU can run this config: "
            + "; ".join(f"{c.gpu.name}: {c.why_not}" for c in ranked)
            + ". Turn activation_checkpointing=on or lower data.batch_size, or catalogue a bigger GPU"
        )
    args = " ".join(overrides)
    name = "lm-" + "-".join(
        o.split("=", 1)[1].replace("_", "-") for o in overrides if o.startswith("+experiment=")
    )
    lines = [
        "# SkyPilot managed spot job. Generated by `lm sky` from conf/gpu/*.yaml: edit the catalog or the",
        "# config, then regenerate (a test fails when this file is stale):",
        f"#   lm sky --out sky/train.yaml{' ' + args if args else ''}",
        "# Launch from the repository root, with SkyPilot installed in its own environment",
        '# (pipx install "skypilot[aws,gcp,runpod]" or pip install -e ".[sky]"; then `sky check`):',
        "#   sky jobs launch -n lm sky/train.yaml --env CKPT_BUCKET=<a bucket name of yours>",
        "#   sky jobs queue; sky jobs logs -n lm      # progress; TensorBoard: on the VM, ~/lm-runs",
        "#",
        f"# GPU candidates, cheapest per token first: $/10^9 tokens = $/h / 3600 / (peak bf16 x MFU {mfu:g}",
        "# / FLOPs per token) x 10^9, FLOPs per token = 6*N_non_embedding + 12*n_layer*d_model*seq_len;",
        f"# memory: ~{chosen[0].need_gb:.0f} GB needed (lm.tools.sky.memory_needed_gb), at most 90% of the GPU's.",
    ]
    for c in ranked:
        price = f"${c.price:.2f}/h {c.pricing}" if c.price is not None else "no price"
        per_b = f"${c.usd_per_billion_tokens:.2f}/B tokens" if c.usd_per_billion_tokens else ""
        verdict = f"left out: {c.why_not}" if c.why_not else f"asks for {c.sky_name}"
        lines.append(f"#   {c.gpu.name:<13} {price:<20} {per_b:<18} {verdict}")
    lines += [
        "# `on_demand` above: the catalog has no spot price for that GPU, so its rank is an upper bound.",
        f"name: {name if name != 'lm-' else 'lm-train'}",
        "",
        "resources:",
        "  use_spot: true",
        "  ordered:  # SkyPilot tries these in order, the next one only when none of this kind is available",
        *[f"    - accelerators: {c.sky_name}:1" for c in chosen],
        "  job_recovery:",
        "    strategy: EAGER_NEXT_REGION  # after a preemption, try another region before waiting in this one",
        "    max_restarts_on_errors: 1  # one fresh machine if `lm supervise` gives up (a bad host)",
        "",
        "envs:",
        "  CKPT_BUCKET: lm-checkpoints  # --env CKPT_BUCKET=... ; an existing S3 bucket (aws s3 mb s3://...)",
        '  TRAIN_ARGS: ""  # more Hydra overrides, e.g. "data=tokens data.dir=s3://my-bucket/tokens"',
        "",
        "workdir: .  # this checkout, synced to ~/sky_workdir on every (re)launch",
        "",
        "# No bucket mount: the run root is on the machine's disk and lm uploads each checkpoint to the bucket",
        "# itself (checkpoint.remote), the newest-checkpoint pointer last, so a reclaim mid-upload never leaves a",
        "# half checkpoint to resume from; a relaunched job on a fresh machine downloads the newest and verifies",
        "# its sha256. A FUSE mount as run root would need symlinks (last.ckpt) and atomic renames, which bucket",
        "# mounts do not promise. Credentials: on AWS the instance role SkyPilot gives its VMs reaches S3;",
        "# elsewhere add --env AWS_ACCESS_KEY_ID=... --env AWS_SECRET_ACCESS_KEY=... (and AWS_ENDPOINT_URL for",
        "# an S3-compatible store).",
        "",
        "setup: |",
        "  set -e",
        "  python3 -m venv ~/lm-venv",
        "  ~/lm-venv/bin/pip install -q torch==2.13.0 -e '.[gpu,cloud]'  # CUDA wheel: pip's default index on Linux",
        "",
        "run: |",
        "  set -e",
        "  source ~/lm-venv/bin/activate",
        "  # Every path this config takes, on this machine, in minutes (exit 1 ends the job before the hours).",
        f"  lm selftest {args + ' ' if args else ''}$TRAIN_ARGS",
        "  # lm supervise reruns after a crash on this machine; a reclaimed machine is SkyPilot's to replace.",
        "  # Either way the command resumes: from the local last.ckpt, or from the bucket on a new machine.",
        f"  lm supervise -- python train.py {args + ' ' if args else ''}run.root=$HOME/lm-runs "
        "checkpoint.remote=s3://$CKPT_BUCKET/runs $TRAIN_ARGS",
        "",
    ]
    return "\n".join(lines)
