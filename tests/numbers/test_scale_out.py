"""Past one GPU: FSDP2's per-GPU memory, GPUs needed, each checkpoint format's host memory and stall, the
format the doctor recommends, and `lm plan --scale-out`."""

import pytest

from lm import cli
from lm.checkpoint.local import format_findings
from lm.model import ModelConfig
from lm.numbers.memory import GiB, estimate, parameter_count
from lm.numbers.scale_out import (
    CHECKPOINT_BYTES,
    fsdp_estimate,
    gpus_needed,
    recommend_format,
    save_plans,
)

V = 32768
ONE_B = ModelConfig(vocab_size=V, n_layer=18, d_model=2048, n_head=16)
EIGHT_B = ModelConfig(vocab_size=V, n_layer=32, d_model=4096, n_head=32, n_kv_head=8, ffn_hidden=14336)
SEVENTY_B = ModelConfig(vocab_size=V, n_layer=80, d_model=8192, n_head=64, n_kv_head=8, ffn_hidden=28672)


def test_sharding_divides_the_states_and_adds_two_gathered_blocks():
    kw = dict(batch_size=1, seq_len=2048, precision="bf16-mixed", ac_every=1, cuda=False)
    one, eight = estimate(EIGHT_B, **kw), estimate(EIGHT_B, **kw, shards=8)
    assert eight.gradients == -(-one.gradients // 8) and eight.optimizer == -(-one.optimizer // 8)
    n, emb = one.params, V * 4096
    gathered = 2 * (n - emb) // 32 * 2  # two blocks' bf16 weights
    assert eight.weights == -(-one.weights // 8) + gathered
    assert (eight.activations, eight.head) == (one.activations, one.head)  # per-device batch unchanged
    assert estimate(EIGHT_B, **kw, shards=1) == one


def test_gpus_needed_grows_with_the_model_as_the_states_say():
    assert parameter_count(EIGHT_B)[0] == pytest.approx(7.25e9, rel=0.01)  # Llama-3-8B less its 128K vocab
    assert parameter_count(SEVENTY_B)[0] == pytest.approx(68.5e9, rel=0.01)
    assert gpus_needed(ONE_B, 80, seq_len=2048) == 1
    assert gpus_needed(EIGHT_B, 80, seq_len=2048) == 4  # 116 GB of states: 2 GPUs of 80 GB cannot
    h100 = gpus_needed(SEVENTY_B, 80, seq_len=2048)
    # 16 bytes of states a parameter: 1.1 TB over 80 GB GPUs is at least 14; whole nodes of 8 past one node
    assert h100 is not None and h100 >= 14 and h100 % 8 == 0
    assert fsdp_estimate(SEVENTY_B, h100, seq_len=2048, precision="bf16-mixed").total <= 80e9 * 0.95
    assert gpus_needed(SEVENTY_B, 24, seq_len=2048, max_gpus=8) is None


def test_each_formats_save_host_memory_and_stall():
    n = int(7e9)
    full, sharded, background = save_plans(n, world=16)
    assert full.host_bytes_per_node == n * CHECKPOINT_BYTES  # gathered whole on rank 0
    assert (
        sharded.host_bytes_per_node == background.host_bytes_per_node == n * CHECKPOINT_BYTES // 2
    )  # 8 of 16
    assert background.stall_s < sharded.stall_s < full.stall_s
    assert background.write_s > background.stall_s  # the write goes on after training resumes


def test_the_recommended_format_follows_the_gathered_size_against_host_memory():
    assert recommend_format(int(7e9), 1, 64 * GiB)[0] == "full"
    small, why = recommend_format(int(134e6), 2, 128 * GiB)
    assert small == "full" and "readable anywhere" in why
    big, why = recommend_format(int(7e9), 8, 128 * GiB)
    assert big == "sharded" and "more than 25%" in why
    assert recommend_format(int(1e9), 16, 2048 * GiB)[0] == "sharded"  # across nodes
    slow, why = recommend_format(int(7e9), 8, 2048 * GiB)  # fits the host, but 78 GiB written alone
    assert slow == "sharded" and "hold every GPU" in why


def test_the_doctor_names_the_format_and_refuses_a_save_that_cannot_fit_host_memory():
    assert format_findings(int(7e9), 1, "fsdp", "full", False, 64 * GiB) == []
    assert format_findings(int(7e9), 8, "ddp", "full", False, 64 * GiB) == []
    (ok,) = format_findings(int(134e6), 2, "fsdp", "full", False, 128 * GiB)
    assert ok.level == "ok" and "full recommended" in ok.what
    (error,) = format_findings(int(7e9), 8, "fsdp", "full", False, 128 * GiB)
    assert error.level == "error" and error.fix == "checkpoint.format=sharded"
    (warn,) = format_findings(int(3e9), 8, "fsdp", "full", False, 128 * GiB)  # 33.5 GiB: > 25%, < 50%
    assert warn.level == "warn" and warn.fix == "checkpoint.format=sharded checkpoint.async_save=true"
    (fine,) = format_findings(int(7e9), 8, "fsdp", "sharded", True, 1024 * GiB)  # an 8-GPU node's host
    assert fine.level == "ok" and "hold every GPU" in fine.what
    assert fine.level == "ok" and "pinned for the run" in fine.what
    (pinned,) = format_findings(int(7e9), 8, "fsdp", "sharded", True, 128 * GiB)  # 78 GiB staged on 128
    assert pinned.level == "error" and pinned.fix.startswith("more nodes")


def test_lm_plan_scale_out_prints_gpus_host_memory_and_stalls(capsys):
    cli.main(
        [
            "plan",
            "--scale-out",
            "model=8b",
            "data.seq_len=2048",
            "data.vocab_size=32768",
            "--gpu",
            "h100_sxm",
            "a100_40gb",
        ]
    )
    out = capsys.readouterr().out
    assert out.startswith("8b: 7.25B parameters, a checkpoint of 81 GiB")
    rows = {
        line.split("|")[1].strip(): line
        for line in out.splitlines()
        if line.startswith("| ") and "GPU" not in line
    }
    assert rows.keys() == {"h100_sxm", "a100_40gb"}
    assert rows["h100_sxm"].split("|")[2].strip() == "4"  # GPUs
    assert rows["a100_40gb"].split("|")[2].strip() == "8"
