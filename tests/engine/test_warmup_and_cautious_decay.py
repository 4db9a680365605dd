"""Issue 36's next levers: the sequence-length warm-up (`data.seq_len_warmup_steps`, short windows first at
equal tokens) and cautious weight decay (`optim.cautious_weight_decay`). Each off by default and today's run
when off; each on: exactly its rule, through a real run and a resume."""

import copy
from dataclasses import asdict, replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lm.base.exits import Refused
from lm.config import DataConfig, OptimConfig, to_objects
from lm.engine import optim
from lm.engine.module import short_windows
from lm.model import ModelConfig, Transformer
from lm.numbers import run_plan
from lm.numbers.batch_ramp import seq_len_warmup, window_len_at
from lm.run.train import main
from lm.store import rundir

from ..run.test_train import weights
from .test_muon import one_thread  # noqa: F401 (a fixture)


def model_with_grads(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(n_layer=2, d_model=64, n_head=4, vocab_size=512))
    batch = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(seed + 1))
    logits = model(batch[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    model.blocks[0].attn.wq.weight.grad = None  # a parameter without a gradient: left alone by both
    return model


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_cautious_decay_is_torchs_decay_masked_where_the_update_opposes_the_parameter(name):
    """One step with cautious decay equals the step without decay minus lr·wd·x on exactly the coordinates
    where the update u (x - x' = lr·u) has the parameter's sign; the groups keep their weight_decay."""
    cfg = OptimConfig(name=name, lr=1e-2, weight_decay=0.3, muon_lr=2e-2, muon_weight_decay=0.2)
    cautious, plain = model_with_grads(), model_with_grads()
    before = {n: p.detach().clone() for n, p in cautious.named_parameters()}
    opt = optim.build(cautious, replace(cfg, cautious_weight_decay=True), fused=False)
    opt.step()
    ref = optim.build(plain, replace(cfg, weight_decay=0.0, muon_weight_decay=0.0), fused=False)
    ref.step()
    assert [g["weight_decay"] for g in opt.param_groups] == [
        g["weight_decay"] for g in optim.build(model_with_grads(), cfg, fused=False).param_groups
    ]
    decays = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    masked = kept = 0
    for (n, p), (_, q) in zip(cautious.named_parameters(), plain.named_parameters(), strict=True):
        x = before[n]
        if p.grad is None:
            assert torch.equal(p, x), n  # torch skips it: no update, no decay
            continue
        lr, wd = decays[id(p)]
        same_sign = (x - q) * x >= 0
        expected = q - lr * wd * x * same_sign
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7, msg=n)
        if wd:
            masked += int((~same_sign).sum())
            kept += int(same_sign.sum())
    assert masked > 0 and kept > 0  # the rule was exercised both ways
    for sa, sb in zip(opt.state.values(), ref.state.values(), strict=True):  # the moments ignore the decay
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_fused_step_the_guards_skip_is_not_decayed_either():
    """The non-finite and spike guards skip a fused AdamW step on the device (`found_inf`): no update, so
    the cautious decay, which would read "no update" as "same sign", must not decay either."""
    model = model_with_grads()
    before = [p.detach().clone() for p in model.parameters()]
    opt = optim.build(model, OptimConfig(lr=1e-2, weight_decay=0.3, cautious_weight_decay=True), fused=True)
    opt.found_inf = torch.ones(())
    opt.step()
    assert all(torch.equal(p, x) for p, x in zip(model.parameters(), before, strict=True))
    opt.found_inf = torch.zeros(())
    opt.step()
    assert not all(torch.equal(p, x) for p, x in zip(model.parameters(), before, strict=True))


class CloneLog(TorchFunctionMode):
    """Records every tensor copy (`Tensor.clone`) in `events`, beside the markers a test appends."""

    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.clone:
            self.events.append("clone")
        return func(*args, **(kwargs or {}))


def test_cautious_decay_copies_the_parameters_after_the_closure_not_at_the_activation_peak():
    """Issue 48: the copy of the decayed parameters is taken once Lightning's closure (forward and backward)
    has returned, so it never sits beside the activations; while the closure runs the groups keep their
    configured decay and nothing has been copied."""
    model = model_with_grads()
    opt = optim.build(model, OptimConfig(lr=1e-2, weight_decay=0.3, cautious_weight_decay=True), fused=False)
    events: list[str] = []

    def closure():
        events.append("closure")
        assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
        return torch.zeros(())

    with CloneLog(events):
        opt.step(closure)
    assert events[0] == "closure" and events.count("clone") > 0, events[:5]


@pytest.mark.parametrize("where", ["closure", "step"])
def test_an_exception_inside_the_step_leaves_the_configured_decay(where):
    """Issue 48: an exception inside the closure (an out-of-memory error in the backward) or inside the step
    itself leaves every group's weight_decay as configured, and the next step decays as a fresh one would."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.3, cautious_weight_decay=True)
    model, reference = model_with_grads(), model_with_grads()
    opt = optim.build(model, cfg, fused=False)

    def fail(*args):
        raise torch.OutOfMemoryError("trial")

    hook = opt.register_step_pre_hook(fail) if where == "step" else None
    with pytest.raises(torch.OutOfMemoryError):
        opt.step(fail if where == "closure" else None)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
    if hook is not None:
        hook.remove()
    opt.step()
    optim.build(reference, cfg, fused=False).step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_cautious_decay_off_is_torchs_adamw_bit_for_bit():
    a, b = model_with_grads(), model_with_grads()
    optim.build(a, OptimConfig(lr=1e-2, weight_decay=0.3), fused=False).step()
    groups = [[p for p in b.parameters() if p.dim() >= 2], [p for p in b.parameters() if p.dim() < 2]]
    torch.optim.AdamW(
        [{"params": groups[0], "weight_decay": 0.3}, {"params": groups[1], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    ).step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_short_windows_predict_the_same_targets_from_shorter_contexts():
    window = torch.arange(2 * 17).reshape(2, 17)
    short = short_windows(window, 4)
    assert short.shape == (8, 5)
    assert torch.equal(short[:, 1:].reshape(2, 16), window[:, 1:])  # every target once, in order
    assert torch.equal(short[:, :-1].reshape(2, 16), window[:, :-1])
    assert short_windows(window, 16) is window


def test_the_warmup_doubles_the_window_in_even_stages_and_is_refused_by_name_when_it_cannot_tile():
    stages = seq_len_warmup(DataConfig(seq_len=64, seq_len_warmup_steps=90, seq_len_warmup_start=0.125))
    assert stages == ((0, 8), (30, 16), (60, 32), (90, 64))
    assert [window_len_at(stages, s) for s in (0, 29, 30, 89, 90, 10**6)] == [8, 8, 16, 32, 64, 64]
    assert seq_len_warmup(DataConfig(seq_len=64)) == ((0, 64),)
    for bad, match in [
        (dict(seq_len_warmup_start=0.3), "must be 1, 1/2, 1/4"),
        (dict(seq_len=18, seq_len_warmup_steps=5), "does not divide into 4 windows"),
        (dict(seq_len_warmup_steps=-1), "seq_len_warmup_steps=-1 must be >= 0"),
    ]:
        with pytest.raises(Refused, match=match):
            DataConfig(**bad)


def test_the_plan_line_names_the_warmup(compose):
    objects = to_objects(
        compose("trainer=cpu", "data.seq_len=64", "data.seq_len_warmup_steps=40", "trainer.max_steps=100")
    )
    plan = run_plan.resolve(objects.data, objects.trainer, objects.optim, world=1)
    assert (
        "sequence-length warm-up: windows of 16 from step 0 -> 32 from step 20 -> 64 from step 40 tokens"
        in plan.end.source
    )
    assert plan.end.tokens == 100 * plan.tokens_per_device_step  # equal tokens: the warm-up adds none


@pytest.mark.slow  # ~9 s: four real runs
@pytest.mark.usefixtures("one_thread")
def test_warmup_and_cautious_decay_train_and_resume_bit_for_bit(tiny_cfg, tmp_path):
    """Both levers through real runs: the warm-up's short windows raise the early training loss (less
    context) and a run stopped mid-warm-up and resumed equals one that never stopped, weights and moments."""
    common = ["data.num_workers=0", "trainer.val_every_steps=8", "trainer.limit_val_batches=1"]
    common += ["optim.total_steps=8", "optim.warmup_steps=2", "checkpoint.every_n_steps=3"]
    common += ["trainer.log_every_n_steps=1", "sampling=off"]
    levers = ["data.seq_len_warmup_steps=6", "optim.cautious_weight_decay=true", "optim.weight_decay=0.5"]
    main(tiny_cfg(*common, "run.name=plain", "trainer.max_steps=8"))
    main(tiny_cfg(*common, *levers, "run.name=straight", "trainer.max_steps=8"))
    main(tiny_cfg(*common, *levers, "run.name=split", "trainer.max_steps=3"))  # inside the first stage
    main(tiny_cfg(*common, *levers, "run.name=split", "trainer.max_steps=8"))
    runs = tmp_path / "runs"
    plain, straight = (rundir.read_scalars(runs / r)["train/loss"] for r in ("plain", "straight"))
    assert plain.values[0] != straight.values[0]  # step 0 trains 16-token windows, not 64
    a, b = (
        torch.load(runs / f"{r}/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
        for r in ("straight", "split")
    )
    assert a["global_step"] == b["global_step"] == 8
    assert [g["weight_decay"] for g in b["optimizer_states"][0]["param_groups"]] == [0.5, 0.0]
    wa, wb = weights(runs / "straight/checkpoints/last.ckpt"), weights(runs / "split/checkpoints/last.ckpt")
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    for sa, sb in zip(*(o["optimizer_states"][0]["state"].values() for o in (a, b)), strict=True):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_both_levers_off_by_default(compose):
    objects = to_objects(compose("trainer=cpu"))
    assert objects.data.seq_len_warmup_steps == 0 and not objects.optim.cautious_weight_decay
    assert asdict(OptimConfig())["cautious_weight_decay"] is False
    assert copy.deepcopy(DataConfig()).seq_len_warmup_steps == 0
