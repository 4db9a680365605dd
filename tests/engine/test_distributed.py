"""Several processes on a CPU (gloo): DDP through Lightning's launcher, FSDP2 through torchrun, SLURM's signal.

W ranks with batch B must train exactly what one process with batch W·B trains: the step sampler gives rank r
the r-th slice of each global batch and gradients are averaged over ranks, so only the order of floating-point
sums differs. Tolerances: per-step losses within 1e-4 and weights within 2e-4 after 6 AdamW steps at lr 1e-3.
Summation order moves them by ~1e-6 (measured: 0 and 5e-6); a rank training on the wrong windows moves the
loss by ~1e-2 and weights by ~lr = 1e-3 per step, far outside.
"""

import functools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from lm.base.exits import Refused
from lm.checkpoint.checkpointer import find_resume_point
from lm.config import TrainerConfig
from lm.data.dataset import StepSampler, val_batches
from lm.engine.activation_checkpointing import Decision, resolve
from lm.engine.parallel import check_strategy, cluster_plugins
from lm.numbers.run_plan import devices_per_node, world_size

from ..conftest import CONF, TINY
from ..conftest import train_in_process as train_here
from ..run.test_train import scalars

ROOT = CONF.parent
B, W, STEPS = 4, 2, 6
RUN = [
    *(o for o in TINY if not o.startswith(("trainer=", "data.batch_size=", "data.num_workers="))),
    "data.num_workers=0",
    "optim.warmup_steps=2",
    "optim.total_steps=9",  # one schedule for the 6-step runs and their 9-step continuations
    "trainer.val_every_steps=3",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "+trainer.extra.num_sanity_val_steps=0",
    "checkpoint.every_n_steps=3",
    "trainer.gradient_clip_val=0.5",  # below the gradient norm (~0.7): clipping acts, across ranks and shards
    "cost.price_per_hour=3.6",  # $0.001 a device-second: dollars = seconds x devices / 1000
]
TOKENS_PER_STEP = W * B * 64  # data.seq_len=64 in TINY
# What srun gives a one-task job step (Lightning's SLURMEnvironment reads ranks and the address from it).
SLURM = {
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_NNODES": "1",
    "SLURM_JOB_NAME": "lm",
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "localhost",
}


def overrides(root: Path, cache: Path, name: str, *extra: str) -> list[str]:
    return [*RUN, f"run.root={root}", f"data.cache_dir={cache}", f"run.name={name}", *extra]


def torchrun(nproc: int) -> list[str]:
    """`torchrun --standalone --nproc-per-node=N train.py`: torchrun starts the ranks, Lightning reads its
    environment (TorchElasticEnvironment)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "train.py",
    ]


def launch(cmd: list[str], ok: bool = True) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert (out.returncode == 0) == ok, out.stderr[-4000:]
    return out


def last(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def losses(run: Path, tag: str = "train/loss") -> dict[int, float]:
    return dict(scalars(run, tag))


def assert_close_losses(run: Path, reference: Path, steps: range) -> None:
    got, want = losses(run), losses(reference)
    for s in steps:
        assert got[s] == pytest.approx(want[s], abs=1e-4), f"train/loss at step {s}"


def assert_close_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=2e-4), k


@pytest.fixture(scope="module")
def reference(root, data_cache) -> Path:
    """One process with the global batch W·B, 9 steps straight (the 6-step runs are its prefix)."""
    assert (
        train_here(
            overrides(
                root, data_cache, "single", f"data.batch_size={W * B}", "trainer=cpu", "trainer.max_steps=9"
            )
        )
        == 0
    )
    return root / "single"


def test_the_ranks_of_a_step_see_the_windows_of_one_process_with_the_global_batch():
    for step in (0, 7, 1000):  # 1000 x 8 windows wraps the epoch of 100: the next permutation
        one = StepSampler(100, W * B, seed=3).micro_batch(step)
        ranks = [StepSampler(100, B, seed=3, world_size=W, rank=r).micro_batch(step) for r in range(W)]
        assert [w for r in ranks for w in r] == one
    one = val_batches(50, W * B)
    ranks = [val_batches(50, B, W, r) for r in range(W)]
    assert len(ranks[0]) == len(ranks[1]) == 50 // (W * B)  # whole global batches: the same forwards per rank
    assert [a + b for a, b in zip(*ranks)] == one[: len(ranks[0])]
    with pytest.raises(Refused, match="fewer than one global batch"):
        val_batches(5, B, W, 0)


@pytest.mark.slow
def test_ddp_matches_one_process_counts_the_world_and_resumes_on_one(root, data_cache, reference, caplog):
    run = root / "ddp"
    # The path users take: Lightning's launcher re-runs this Hydra script once per extra rank.
    launch(
        [
            sys.executable,
            "train.py",
            *overrides(
                root,
                data_cache,
                "ddp",
                "trainer=ddp",
                "trainer.accelerator=cpu",
                f"trainer.devices={W}",
                f"data.batch_size={B}",
                f"trainer.max_steps={STEPS}",
            ),
        ]
    )

    assert_close_losses(run, reference, range(STEPS))
    for step, value in losses(reference, "val/loss").items():
        if step < STEPS:  # the ranks validate the windows one process does
            assert losses(run, "val/loss")[step] == pytest.approx(value, abs=1e-4)
    ckpt = last(run)
    assert ckpt["global_step"] == STEPS
    straight = torch.load(reference / "checkpoints" / "step-6.ckpt", map_location="cpu", weights_only=False)
    assert_close_weights(ckpt["state_dict"], straight["state_dict"])

    # Tokens and dollars count the whole world: W devices, W·B windows a step.
    ledger = json.loads((run / "cost.json").read_text())
    assert ledger["devices"] == W and ledger["tokens"] == STEPS * TOKENS_PER_STEP
    assert ledger["usd"] == pytest.approx(sum(ledger["seconds"].values()) * 3.6 * W / 3600)
    assert losses(run, "train/tokens")[STEPS - 1] == STEPS * TOKENS_PER_STEP

    # Rank 0 alone writes the run's files: one of each, nothing left half-written by another rank.
    writers = {p.name.rsplit(".", 2)[1] for p in (run / "tb").glob("events.out.tfevents.*")}
    assert len(writers) == 1  # events.out.tfevents.<time>.<host>.<pid>.<n>: one process
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "last.ckpt",
        "step-3.ckpt",
        "step-6.ckpt",
    ]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == len({(s["step"], s["prompt"], s["mode"]) for s in samples}) > 0
    assert [p.name for p in (run / "hydra").iterdir()] == [next((run / "hydra").iterdir()).name]
    assert (run / "phases.csv").is_file() and (run / "report.md").is_file()

    # A different world size resumes it: one process, the global batch, steps 7-9 as the straight run.
    assert (
        train_here(
            overrides(
                root, data_cache, "ddp", "trainer=cpu", f"data.batch_size={W * B}", "trainer.max_steps=9"
            )
        )
        == 0
    )
    assert last(run)["global_step"] == 9
    assert_close_losses(run, reference, range(STEPS, 9))
    assert_close_weights(last(run)["state_dict"], last(reference)["state_dict"])
    assert json.loads((run / "cost.json").read_text())["tokens"] == 9 * TOKENS_PER_STEP
    assert "re-read or skipped" not in caplog.text  # the global batch was kept

    # Half the global batch (as if 2 GPUs became 1 without doubling data.batch_size): trains, but says so.
    assert (
        train_here(
            overrides(root, data_cache, "ddp", "trainer=cpu", f"data.batch_size={B}", "trainer.max_steps=10")
        )
        == 0
    )
    assert "windows are re-read or skipped" in caplog.text


@pytest.mark.slow  # over ~15 s on 2 cores: CI's second pass
def test_fsdp_under_torchrun_matches_one_process_and_resumes_on_one(root, data_cache, reference):
    run = root / "fsdp"
    # torchrun starts the ranks; Lightning reads its environment (TorchElasticEnvironment).
    launch(
        [
            *torchrun(W),
            *overrides(
                root,
                data_cache,
                "fsdp",
                "trainer=fsdp",
                "activation_checkpointing=on",  # recomputed inside each sharded block
                "trainer.accelerator=cpu",
                f"trainer.devices={W}",
                f"data.batch_size={B}",
                f"trainer.max_steps={STEPS}",
            ),
        ]
    )

    assert_close_losses(run, reference, range(STEPS))
    ckpt = last(run)  # a full state dict: one file with ordinary (unsharded) tensors
    straight = torch.load(reference / "checkpoints" / "step-6.ckpt", map_location="cpu", weights_only=False)
    assert_close_weights(ckpt["state_dict"], straight["state_dict"])
    assert json.loads((run / "cost.json").read_text())["tokens"] == STEPS * TOKENS_PER_STEP

    # Weights and AdamW moments resume on one process without FSDP: steps 7-9 as the straight run.
    assert (
        train_here(
            overrides(
                root, data_cache, "fsdp", "trainer=cpu", f"data.batch_size={W * B}", "trainer.max_steps=9"
            )
        )
        == 0
    )
    assert_close_losses(run, reference, range(STEPS, 9))
    assert_close_weights(last(run)["state_dict"], last(reference)["state_dict"])


def test_slurm_plugin_turns_lightnings_requeue_off_only_under_slurm(monkeypatch):
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    assert cluster_plugins() == []
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    (plugin,) = cluster_plugins()
    assert isinstance(plugin, SLURMEnvironment) and not plugin.auto_requeue


@pytest.mark.slow
def test_sbatch_script_requeues_after_spotguards_sigusr1_save_and_ends_when_done(root, data_cache, tmp_path):
    """slurm/train.sbatch as SLURM runs it, with `srun` running its one task here and `scontrol` recorded."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nexec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {
        **os.environ,
        **SLURM,
        "SLURM_SUBMIT_DIR": str(ROOT),
        "PYTHON": sys.executable,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    }
    fault = ["+callbacks.fault._target_=tests.faults.Fault", "+callbacks.fault.action=sigusr1", "+callbacks.fault.step=2", f"+callbacks.fault.marker={root / 'slurm.fired'}"]  # fmt: skip
    args = overrides(root, data_cache, "slurm", "trainer.accelerator=cpu", f"data.batch_size={B}", f"trainer.max_steps={STEPS}", *fault)  # fmt: skip
    run = root / "slurm"

    def sbatch() -> None:
        out = subprocess.run(["bash", "slurm/train.sbatch", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]

    sbatch()  # SIGUSR1 before step 2: the step boundary saves step 3, exits 75, the script requeues the job
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", SLURM["SLURM_JOB_ID"]]
    assert last(run)["global_step"] == 3
    assert not list(run.rglob("hpc_ckpt_*"))  # Lightning's SLURM handler saved nothing of its own
    sbatch()  # the requeued job resumes, finishes, and is not requeued again
    assert last(run)["global_step"] == STEPS
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", SLURM["SLURM_JOB_ID"]]


def test_lightnings_fsdp1_names_are_refused_with_the_fix():
    with pytest.raises(Refused, match="use trainer=fsdp"):
        check_strategy("fsdp_cpu_offload", 1, multirun=False)
    check_strategy("fsdp", 2, multirun=False)
    check_strategy("ddp", 2, multirun=False)


def test_a_sweep_cannot_start_processes_with_lightnings_launcher(monkeypatch):
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    with pytest.raises(Refused, match="one command per sweep point"):
        check_strategy("ddp", 2, multirun=True)
    check_strategy("ddp", 2, multirun=False)  # one run: Lightning's launcher is the way
    check_strategy("ddp", 1, multirun=True)  # one process per job: nothing is re-run
    check_strategy("ddp_spawn", 2, multirun=True)  # spawn does not re-run the command line
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "sweep")  # torchrun started the ranks: each runs the sweep
    check_strategy("ddp", 2, multirun=True)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    for devices in (-1, "-1", "2", [0, 1]):  # every spelling of several processes, as the plan counts them
        with pytest.raises(Refused, match="one command per sweep point"):
            check_strategy("ddp", devices, multirun=True)


def test_one_reading_of_trainer_devices_counts_the_ranks():
    """lm.numbers.run_plan.devices_per_node serves the plan, the doctor and the multirun check alike."""
    assert [devices_per_node(d, gpus=0) for d in (3, "2", [0, 1], "auto", -1, "-1")] == [3, 2, 2, 1, 1, 1]
    assert [devices_per_node(d, gpus=4) for d in ("auto", -1, 1)] == [4, 4, 1]
    trainer = TrainerConfig(accelerator="cpu", devices=2, num_nodes=3)
    assert world_size(trainer) == 6 and world_size(trainer, cuda=True) == 6


def test_a_rank_other_than_0_resumes_while_rank_0_repoints_last(tmp_path, monkeypatch):
    """Under torchrun every rank looks at once; a dangling last.ckpt (rank 0 mid-repair) must not start it fresh."""
    from lightning.pytorch.utilities import rank_zero_only

    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step-3.ckpt").write_bytes(b"whatever rank 0 decides")
    (ckpts / "last.ckpt").symlink_to("step-6.ckpt")  # its target just moved to corrupt/
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert find_resume_point(tmp_path / "run") == ckpts / "last.ckpt"
    assert (ckpts / "step-3.ckpt").is_file()  # only rank 0 repairs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp_bf16_compiled_on_gpus_trains_and_resumes_on_one(root, data_cache):
    """The GPU-only parts of FSDP: bf16 all-gathers (MixedPrecisionPolicy), per-block compile, NCCL."""
    n = min(2, torch.cuda.device_count())
    gpu = ["trainer.accelerator=gpu", "precision=bf16", "kernels=compile", "activation_checkpointing=on"]
    launch(
        [
            *torchrun(n),
            *overrides(
                root,
                data_cache,
                "fsdp-gpu",
                "trainer=fsdp",
                *gpu,
                f"trainer.devices={n}",
                f"data.batch_size={B}",
                f"trainer.max_steps={STEPS}",
            ),
        ]
    )
    run = root / "fsdp-gpu"
    loss = losses(run)
    assert all(math.isfinite(v) for v in loss.values()) and loss[STEPS - 1] < loss[0]
    ckpt = last(run)
    assert ckpt["global_step"] == STEPS
    assert all(t.dtype == torch.float32 for t in ckpt["state_dict"].values())  # shards stay fp32
    args = overrides(root, data_cache, "fsdp-gpu", *gpu, f"data.batch_size={n * B}", "trainer.max_steps=9")
    assert train_here(args) == 0  # one GPU, no FSDP
    assert last(run)["global_step"] == 9


@pytest.mark.slow  # over ~15 s on 2 cores: CI's second pass
def test_ranks_that_would_resume_from_different_steps_stop_before_training(root, data_cache, reference):
    """A run.root that only rank 0 sees: rank 0 resumes at step 9, rank 1 would start fresh beside it."""
    shutil.copytree(reference, root / "split0" / "single")
    ckpts = sorted(p.name for p in (root / "split0" / "single" / "checkpoints").iterdir())
    out = launch(
        [
            *torchrun(W),
            *overrides(
                root,
                data_cache,
                "single",
                "trainer=ddp",
                "trainer.accelerator=cpu",
                f"trainer.devices={W}",
                f"data.batch_size={B}",
                "trainer.max_steps=12",
            ),
            f"run.root={root}/split${{oc.env:RANK}}",  # each rank its own folder, as on unshared disks
        ],
        ok=False,
    )
    assert "every node must see the same checkpoints" in out.stderr
    assert sorted(p.name for p in (root / "split0" / "single" / "checkpoints").iterdir()) == ckpts


@pytest.mark.slow  # 14-22 s on 2 cores: headroom under the README command's 10 min
def test_a_stop_signal_to_one_rank_saves_the_same_step_on_both_and_exits_75(root, data_cache):
    """SIGUSR1 to rank 1 only, before step 0's forward: the ranks agree on it one step later (Consensus
    pipelines the agreement so no step waits on the device), both save step 2 together and exit 75 (each logs it just before exiting)."""
    fault = ["+callbacks.fault._target_=tests.faults.Fault", "+callbacks.fault.action=sigusr1", "+callbacks.fault.step=0", "+callbacks.fault.rank=1", f"+callbacks.fault.marker={root / 'one-rank.fired'}"]  # fmt: skip
    args = overrides(root, data_cache, "one-rank-stop", "trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={W}", f"data.batch_size={B}", f"trainer.max_steps={STEPS}", *fault)  # fmt: skip
    out = launch([*torchrun(W), *args], ok=False)
    log = out.stdout + out.stderr
    assert (root / "one-rank.fired").is_file()
    assert log.count("SIGUSR1: saved step 2; exiting with 75") == 1, log[-4000:]  # rank 1, which received it
    assert log.count("a stop signal to another rank: saved step 2; exiting with 75") == 1, log[-4000:]
    # torchrun reports the first rank to exit (75) and stops the other, which may still be on its way out.
    codes = [
        line.split(":")[1].split()[0] for line in log.splitlines() if line.strip().startswith("exitcode")
    ]
    assert "75" in codes and set(codes) <= {"75", "-15"}, log[-4000:]
    assert last(root / "one-rank-stop")["global_step"] == 2


# Stand-in trial peaks (bytes) per stride of the tiny 2-block model: off, 1 block in 2, every block.
PEAKS = {0: 300, 2: 200, 1: 100}
FREE = {0: 250, 1: 1000}  # rank 0's GPU is the fuller one: alone, rank 1 would train without checkpointing


def stand_in_decision(out: str, n_layer: int = 2) -> Decision:
    """`activation_checkpointing=auto` as a rank with FREE[rank] bytes free decides it (a CPU stand-in for
    the CUDA trial probe); records that this rank probed."""
    rank = int(os.environ.get("RANK", "0"))
    (Path(out) / f"probed-{rank}").write_text("")
    return resolve(0, True, n_layer, probe=PEAKS.get, budget_bytes=FREE[rank], free_memory_reserve=0.0)


class StandInProbe(pl.Callback):
    """Hands the module `stand_in_decision` as its `activation_checkpointing=auto` probe (a CUDA trial on a GPU),
    at setup: before the module's own setup, where rank 0 runs it."""

    def __init__(self, out: str) -> None:
        self.out = out

    def setup(self, trainer, pl_module, stage) -> None:
        pl_module.decide_stride = functools.partial(stand_in_decision, self.out)


class RecordStride(pl.Callback):
    """Writes the stride this rank trains with to <out>/stride-<rank>.json."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_start(self, trainer, pl_module) -> None:
        (self.out / f"stride-{trainer.global_rank}.json").write_text(json.dumps(pl_module.model.ac_every))


@pytest.mark.slow  # over ~15 s on 2 cores: CI's second pass
def test_auto_activation_checkpointing_is_rank_0s_choice_on_every_rank(root, data_cache, tmp_path):
    """Ranks with different free memory would choose different strides; rank 0 probes and all follow."""
    ac = "+callbacks.ac"
    callbacks = [
        f"{ac}._target_=tests.engine.test_distributed.StandInProbe",
        f"{ac}.out={tmp_path}",
        "+callbacks.record._target_=tests.engine.test_distributed.RecordStride",
        f"+callbacks.record.out={tmp_path}",
    ]
    args = overrides(root, data_cache, "ac-auto", "trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={W}", f"data.batch_size={B}", "trainer.max_steps=2", "activation_checkpointing=auto", *callbacks)  # fmt: skip
    launch([*torchrun(W), *args])
    assert (
        resolve(0, True, 2, probe=PEAKS.get, budget_bytes=FREE[1], free_memory_reserve=0.0).every == 0
    )  # rank 1's own
    assert [json.loads((tmp_path / f"stride-{r}.json").read_text()) for r in range(W)] == [2, 2]
    assert sorted(p.name for p in tmp_path.glob("probed-*")) == ["probed-0"]  # only rank 0 measured
    ledger = json.loads((root / "ac-auto" / "cost.json").read_text())
    assert ledger["run"]["activation_checkpointing"] == 2
