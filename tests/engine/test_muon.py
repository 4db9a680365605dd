"""optim=muon: which tensors Muon gets, what its update is, one optimizer object through checkpoints, resume,
DDP (FSDP2: test_muon_fsdp.py)."""

import copy
import json
import re
import sys
from dataclasses import asdict

import pytest
import torch

from lm.base.exits import Refused
from lm.checkpoint.resume_check import check_resumable
from lm.config import POLAR_EXPRESS_STEPS, OptimConfig, to_objects
from lm.engine import optim
from lm.model import ModelConfig, Transformer
from lm.run.doctor import diagnose, resolve_target
from lm.run.train import main
from lm.store.bench_file import Result
from lm.tools.bench import optimizer_overhead, run_bench

from ..conftest import TINY
from ..run.test_sweep import compose_with_hydra
from ..run.test_train import weights
from ..tools.test_bench import TINY_BENCH
from .test_distributed import STEPS, B, W, assert_close_losses, assert_close_weights, last, launch, overrides

MUON = OptimConfig(name="muon", lr=2e-3, weight_decay=0.1, muon_lr=0.02, muon_weight_decay=0.05)
BLOCK_MATRIX = re.compile(r"blocks\.\d+\.(attn\.w[qkvo]|mlp\.w[123])\.weight")


def tiny_model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{"n_layer": 2, "d_model": 64, "n_head": 4, "vocab_size": 512, **kw}))


def names(model: torch.nn.Module, params: list[torch.Tensor]) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("tie", [False, True])
def test_muon_gets_the_blocks_matrices_and_adamw_the_embedding_head_and_norms(tie):
    model = tiny_model(tie_embeddings=tie)
    muon, matrices, gains = (names(model, ps) for ps in optim.split_params(model, MUON))
    every = {n for n, _ in model.named_parameters()}
    assert muon == {n for n in every if BLOCK_MATRIX.fullmatch(n)} and len(muon) == 2 * 7
    assert matrices == ({"tok_emb.weight"} if tie else {"tok_emb.weight", "lm_head.weight"})
    assert gains and all(n.endswith("norm.weight") for n in gains)
    assert muon | matrices | gains == every  # nothing left out, nothing twice (a tied head is one tensor)

    opt = optim.build(model, MUON, fused=False)
    kinds = [(g["kind"], g["lr"], g["weight_decay"]) for g in opt.param_groups]
    assert kinds == [("muon", 0.02, 0.05), ("adamw", 2e-3, 0.1), ("adamw", 2e-3, 0.0)]
    assert opt.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    plain = optim.build(model, OptimConfig(), fused=False)  # optim=adamw: the groups it always had
    assert type(plain) is torch.optim.AdamW and [len(g["params"]) for g in plain.param_groups] == [
        len(muon) + len(matrices),
        len(gains),
    ]


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (96, 96)])
def test_muons_update_of_a_matrix_is_orthogonal_within_the_quintic_iterations_band(shape):
    """torch's 5-step quintic Newton-Schulz trades exactness for speed: singular values land in ~[0.68, 1.21]
    (measured), not at 1. A gradient whose singular values span 100x must come out inside that band."""
    torch.manual_seed(0)
    u, _, v = torch.linalg.svd(torch.randn(shape), full_matrices=False)
    grad = u @ torch.diag(torch.logspace(0, -2, min(shape))) @ v
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = grad
    # No momentum, no decay, Keller Jordan's scale: the step is -sqrt(max(1, rows/cols)) x NS(grad).
    torch.optim.Muon([p], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False).step()
    update = -p.detach() / max(1.0, shape[0] / shape[1]) ** 0.5
    singular = torch.linalg.svdvals(update)
    assert singular.min() > 0.6 and singular.max() < 1.25, singular
    # Moonlight's scale, the one lm adopts: the update's RMS is ~0.2 x lr, AdamW's typical update RMS.
    q = torch.nn.Parameter(torch.zeros(shape))
    q.grad = grad
    torch.optim.Muon([q], lr=1e-3, weight_decay=0.0, momentum=0.0, adjust_lr_fn="match_rms_adamw").step()
    assert 0.15 < q.detach().pow(2).mean().sqrt() / 1e-3 < 0.25


def step(model: Transformer, opt: torch.optim.Optimizer, seed: int) -> None:
    idx = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(seed))
    logits = model(idx[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def one_thread():
    """Tensors this small run fastest on one thread; two fight over a shared machine's cores (measured: 5 s
    against 0.5 s a step on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
def test_one_optimizer_round_trips_its_state_and_skips_parameters_without_gradients(one_thread, coefficients):
    """The guards drop every gradient to skip a step; state_dict/load_state_dict carries Muon's momentum and
    AdamW's moments, so a restored copy takes the very same next steps. Polar Express keeps torch's layout."""
    cfg = OptimConfig(**{**asdict(MUON), "ns_coefficients": coefficients})
    model = tiny_model()
    opt = optim.build(model, cfg, fused=False)
    step(model, opt, 0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt.step()  # no gradients: a skipped step changes nothing
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert {tuple(s) for s in opt.state_dict()["state"].values()} == {
        ("momentum_buffer",),
        ("step", "exp_avg", "exp_avg_sq"),
    }

    twin = tiny_model()
    twin.load_state_dict(model.state_dict())
    restored = optim.build(twin, cfg, fused=False)
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a file: no tensor shared
    for seed in (1, 2):
        step(model, opt, seed)
        step(twin, restored, seed)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def orthogonality_error(update: torch.Tensor) -> tuple[float, float]:
    """max and mean |singular value - 1|, in float64."""
    dev = (torch.linalg.svdvals(update.double()) - 1).abs()
    return dev.max().item(), dev.mean().item()


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (128, 128)])
def test_polar_express_orthogonalises_better_than_the_quintic_in_five_steps(shape):
    """At the 5 steps its coefficients were computed for, Polar Express lands closer to orthogonal than torch's
    quintic, both worst case and on average. (Its 2-4 step prefixes do not: experiments/2026-11-25-muon-ns.)"""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    quintic = torch.optim._muon._zeropower_via_newtonschulz(g, optim.QUINTIC, 5, 1e-7)
    polar = optim.polar_express(g, 5, 1e-7)
    assert polar.dtype == quintic.dtype == torch.bfloat16 and polar.shape == shape
    (q_max, q_mean), (p_max, p_mean) = orthogonality_error(quintic), orthogonality_error(polar)
    assert p_max < 0.8 * q_max and p_mean < 0.6 * q_mean, (q_max, q_mean, p_max, p_mean)


def test_polar_express_steps_keep_torchs_momentum_decay_and_lr_scale():
    """One PolarExpressMuon step is torch's Muon update with the orthogonaliser swapped: Nesterov momentum,
    decoupled decay, Moonlight's LR scale."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(32, 96))
    start, grad = p.detach().clone(), torch.randn(32, 96)
    p.grad = grad.clone()
    opt = optim.PolarExpressMuon(
        [p], lr=0.01, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw", ns_steps=3
    )
    opt.step()
    buf = torch.zeros_like(grad).lerp_(grad, 1 - 0.9)  # (1 - momentum) * grad
    update = optim.polar_express(
        grad.lerp(buf, 0.9), 3, 1e-7
    ).float()  # Nesterov: grad + momentum * (buf - grad)
    want = (
        start * (1 - 0.01 * 0.1) - 0.01 * 0.2 * 96**0.5 * update
    )  # decay, then Moonlight's 0.2 sqrt(max dim)
    torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)
    assert torch.equal(opt.state[p]["momentum_buffer"], buf)


def test_ns_coefficients_are_checked_with_the_choices_and_the_step_limit_named():
    with pytest.raises(
        Refused, match=r"optim.ns_coefficients='cubic' is unknown; use one of quintic, polar_express"
    ):
        OptimConfig(name="muon", ns_coefficients="cubic")
    with pytest.raises(
        Refused, match=r"optim.ns_steps=6 with optim.ns_coefficients=polar_express.*ns_steps<=5"
    ):
        OptimConfig(name="muon", ns_coefficients="polar_express", ns_steps=6)
    assert len(optim.POLAR_EXPRESS) == POLAR_EXPRESS_STEPS  # the limit is the table's length


def test_muon_flops_scale_with_ns_steps_and_not_with_the_coefficients():
    model = ModelConfig(n_layer=2, d_model=64, n_head=4, vocab_size=512)
    five = optim.muon_flops_per_step(model, MUON)
    for steps in (1, 2, 3, 4):
        for coefficients in ("quintic", "polar_express"):
            cfg = OptimConfig(**{**asdict(MUON), "ns_steps": steps, "ns_coefficients": coefficients})
            assert optim.muon_flops_per_step(model, cfg) == pytest.approx(five * steps / 5)
    line = optim.describe(model, OptimConfig(name="muon", ns_coefficients="polar_express", ns_steps=3))
    assert "3 Newton-Schulz steps, polar_express" in line


def test_a_polar_express_run_trains_and_resumes_bit_for_bit(tiny_cfg, tmp_path, one_thread):
    """optim.ns_coefficients=polar_express through a real run: its groups reach the checkpoint, and a run
    stopped at step 3 and resumed to 6 equals one that never stopped (the state layout is torch's)."""
    common = ["optim=muon", "optim.ns_coefficients=polar_express", "optim.ns_steps=3", "data.num_workers=0"]
    common += ["trainer.val_every_steps=6", "trainer.limit_val_batches=1", "optim.total_steps=6"]
    common += ["optim.warmup_steps=2", "checkpoint.every_n_steps=3"]
    main(tiny_cfg(*common, "run.name=straight", "trainer.max_steps=6"))
    main(tiny_cfg(*common, "run.name=split", "trainer.max_steps=3"))
    main(tiny_cfg(*common, "run.name=split", "trainer.max_steps=6"))
    a, b = (
        torch.load(tmp_path / f"runs/{r}/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
        for r in ("straight", "split")
    )
    assert a["global_step"] == b["global_step"] == 6
    group = b["optimizer_states"][0]["param_groups"][0]
    assert (group["kind"], group["ns_coefficients"], group["ns_steps"]) == ("muon", "polar_express", 3)
    for name, w in a["state_dict"].items():
        assert torch.equal(w, b["state_dict"][name]), name
    for sa, sb in zip(*(o["optimizer_states"][0]["state"].values() for o in (a, b)), strict=True):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_an_unknown_optimizer_is_refused_with_the_choices(compose):
    to_objects(compose(*TINY, "optim=muon", "trainer=fsdp"))  # Muon shards (tests/engine/test_muon_fsdp.py)
    with pytest.raises(Refused, match="optim.name='sgd' is unknown"):
        to_objects(compose(*TINY, "optim=muon", "optim.name=sgd"))


@pytest.mark.slow
def test_a_resumed_muon_run_equals_an_uninterrupted_one_bit_for_bit(tiny_cfg, tmp_path):
    common = ["optim=muon", "trainer.val_every_steps=10", "optim.total_steps=12", "optim.warmup_steps=3"]
    common += ["data.num_workers=0", "trainer.limit_val_batches=1", "checkpoint.every_n_steps=4"]
    main(tiny_cfg(*common, "run.name=straight", "trainer.max_steps=12"))
    main(tiny_cfg(*common, "run.name=split", "trainer.max_steps=6"))  # between checkpoint intervals
    main(tiny_cfg(*common, "run.name=split", "trainer.max_steps=12"))
    runs = tmp_path / "runs"
    straight, split = (weights(runs / f"{r}/checkpoints/last.ckpt") for r in ("straight", "split"))
    assert straight.keys() == split.keys()
    for name in straight:
        assert torch.equal(straight[name], split[name]), name
    a, b = (
        torch.load(runs / f"{r}/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
        for r in ("straight", "split")
    )
    moments = [(sa, sb) for sa, sb in zip(*(o["optimizer_states"][0]["state"].values() for o in (a, b)))]
    assert len(moments) == len(straight)  # every parameter has optimizer state, Muon's and AdamW's
    for sa, sb in moments:
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_muon_under_ddp_on_2_gloo_ranks_matches_one_process_with_the_global_batch(tmp_path, data_cache):
    """test_distributed's method with optim=muon: Newton-Schulz runs on every rank on the same averaged
    gradient, so the ranks stay identical and equal one process up to summation order."""
    single = overrides(
        tmp_path, data_cache, "single", "optim=muon", f"data.batch_size={W * B}", "trainer=cpu"
    )
    launch([sys.executable, "train.py", *single, f"trainer.max_steps={STEPS}"])
    ddp = [
        "optim=muon",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        f"trainer.devices={W}",
        f"data.batch_size={B}",
    ]
    launch(
        [
            sys.executable,
            "train.py",
            *overrides(tmp_path, data_cache, "ddp", *ddp, f"trainer.max_steps={STEPS}"),
        ]
    )
    assert_close_losses(tmp_path / "ddp", tmp_path / "single", range(STEPS))
    assert_close_weights(last(tmp_path / "ddp")["state_dict"], last(tmp_path / "single")["state_dict"])
    assert last(tmp_path / "ddp")["optimizer_states"][0]["param_groups"][0]["kind"] == "muon"


def test_the_doctor_says_which_parameters_muon_takes_and_its_lr_scale(compose):
    t = resolve_target(to_objects(compose(*TINY, "optim=muon", "optim.muon_lr=0.02")))
    (line,) = [f.what for f in diagnose(t) if f.check == "optimizer"]
    assert line.startswith("Muon on 14 block matrices") and "lr 0.02" in line and "match_rms_adamw" in line
    assert "AdamW on 2 embedding/head matrices" in line and "5 norm gains" in line
    plain = resolve_target(to_objects(compose(*TINY)))
    assert not [f for f in diagnose(plain) if f.check == "optimizer"]  # AdamW alone: nothing to say


@pytest.mark.slow
def test_bench_puts_muons_step_time_overhead_beside_adamws(tmp_path):
    """A real `lm bench optim=adamw,muon`: two rows, and the line that compares their step times."""
    out = tmp_path / "bench"
    assert run_bench([*TINY_BENCH, "data.batch_size=4", "optim=adamw,muon", f"bench.out_dir={out}"]) == 0
    rows = {" ".join(r["combo"]): r for r in json.loads((out / "bench.json").read_text())["results"]}
    assert rows["optim=adamw"]["status"] == rows["optim=muon"]["status"] == "ok"
    overhead = rows["optim=adamw"]["tokens_per_sec"] / rows["optim=muon"]["tokens_per_sec"] - 1
    assert (
        f"optim=muon (the same settings): step time {overhead:+.1%} against optim=adamw"
        in (out / "bench.md").read_text()
    )
    lines = optimizer_overhead(
        [
            Result(["kernels=compile", "optim=adamw"], status="ok", tokens_per_sec=300.0),
            Result(["kernels=compile", "optim=muon"], status="ok", tokens_per_sec=200.0),
            Result(
                ["kernels=eager", "optim=muon"], status="ok", tokens_per_sec=100.0
            ),  # no AdamW row to match
        ]
    )
    assert lines == ["optim=muon (kernels=compile): step time +50.0% against optim=adamw"]


def test_sweep_lr_and_optuna_sweep_muons_lr():
    """Under match_rms_adamw one `optim.lr` drives both optimizers, so `+experiment=sweep_lr optim=muon` sweeps
    Muon as it is; Muon's own LR is one more sweeper parameter (README, conf/hydra/sweeper/lm_optuna.yaml)."""
    grid = compose_with_hydra("+experiment=sweep_lr", "optim=muon")
    assert grid.optim.name == "muon" and grid.optim.muon_lr is None and grid.optim.total_steps == 2000
    assert len(grid.hydra.sweeper.params["optim.lr"].split(",")) == 8
    own = compose_with_hydra(
        "+experiment=sweep_lr",
        "optim=muon",
        '++hydra.sweeper.params={optim.lr:"3e-4",optim.muon_lr:"1e-3,3e-3"}',
    )
    assert dict(own.hydra.sweeper.params) == {"optim.lr": "3e-4", "optim.muon_lr": "1e-3,3e-3"}
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    tpe = compose_with_hydra(
        "hydra/sweeper=lm_optuna",
        "optim=muon",
        '++hydra.sweeper.params={optim.muon_lr:"tag(log, interval(3e-4, 1e-2))"}',
    )
    assert tpe.optim.name == "muon" and set(tpe.hydra.sweeper.params) == {"optim.lr", "optim.muon_lr"}


@pytest.mark.slow
def test_muon_trains_under_bf16_mixed_compile_accumulation_and_clipping(tiny_cfg, tmp_path):
    knobs = [
        "precision=bf16",
        "kernels=compile",
        "trainer.accumulate_grad_batches=2",
        "trainer.gradient_clip_val=0.1",
    ]
    main(
        tiny_cfg(
            "optim=muon", *knobs, "trainer.max_steps=4", "data.num_workers=0", "trainer.limit_val_batches=1"
        )
    )
    ckpt = torch.load(tmp_path / "runs/smoke/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4 and ckpt["optimizer_states"][0]["param_groups"][0]["kind"] == "muon"
    buffers = [
        s["momentum_buffer"] for s in ckpt["optimizer_states"][0]["state"].values() if "momentum_buffer" in s
    ]
    assert len(buffers) == 14 and all(b.dtype == torch.float32 and b.abs().sum() > 0 for b in buffers)
    assert all(torch.isfinite(w).all() for w in ckpt["state_dict"].values())


def test_resuming_with_the_other_optimizer_is_refused_with_the_fix(tmp_path):
    """AdamW's two groups of moments cannot become Muon's three groups (nor back): named before any load."""
    model = ModelConfig(n_layer=2, d_model=64, n_head=4, vocab_size=512)
    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 5, "hyper_parameters": {"model": asdict(model), "optim": {"lr": 1e-3}}}, path)
    check_resumable(path, model, "adamw")  # a checkpoint from before optim.name: AdamW's
    with pytest.raises(Refused, match=r"optim=adamw, this config has optim=muon.*set optim=adamw"):
        check_resumable(path, model, "muon")
