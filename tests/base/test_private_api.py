"""lm.base.private_api: each private name of torch and Lightning lm reaches is still where lm reaches it.

A release that renames one fails here, naming it, instead of breaking a resume, a sharded read or Muon's step
silently. And nothing else in src/lm names a framework's private attribute.
"""

import ast
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import ModelParallelStrategy

from lm.base import private_api

SRC = Path(__file__).resolve().parents[2] / "src" / "lm"


def test_lightnings_insides_are_where_lm_reaches_them():
    assert callable(_TrainingEpochLoop._broadcast_sigterm_tensor)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert (
        trainer.fit_loop._combined_loader is None
        and trainer.fit_loop.epoch_loop.val_loop._combined_loader is None
    )
    private_api.shutdown_data_workers(trainer)  # a no-op before fit
    private_api.skip_sigterm_broadcast(trainer)
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # the stand-in: no collective, no raise
    strategy = ModelParallelStrategy()
    assert strategy._data_parallel_size == "auto" and strategy._tensor_parallel_size == "auto"


def test_torchs_insides_are_where_lm_reaches_them(tmp_path):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    private_api.set_last_lr(scheduler, [0.05])
    assert scheduler.get_last_lr() == [0.05]
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    assert float(private_api.loss_scale(scaler)) == 8.0
    matrix = torch.nn.Parameter(torch.randn(8, 4))
    muon = torch.optim.Muon([matrix], lr=0.01)
    matrix.grad = torch.randn(8, 4)
    params, grads, bufs = private_api.muon_tensors(muon, muon.param_groups[0])
    assert params == [matrix] and grads[0] is matrix.grad and bufs[0].shape == matrix.shape
    ortho = private_api.newton_schulz(matrix.grad, private_api.MUON_QUINTIC, 5, 1e-7)
    assert ortho.shape == (8, 4) and private_api.muon_adjust_lr(0.01, None, matrix.shape) > 0
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert torch.equal(private_api.read_sharded_whole(tmp_path / "dcp")["w"], torch.arange(6.0))


def private_references(path: Path) -> list[str]:
    """`x._name` attribute references and `_name` imports from other packages in one file, where `x` is not
    `self`/`cls` (lm's own private names are its business)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("lm"):
            parts = [*node.module.split("."), *(a.name for a in node.names)]
            found += [
                f"{path.name}:{node.lineno} {node.module}"
                for p in parts
                if p.startswith("_") and p != "__future__"
            ]
    return found


def test_no_framework_private_name_outside_the_adapter():
    allowed = {"exits.py": {"._register_atexit", "._exit"}}  # the standard library's, for the exit bound
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "private_api.py":
            continue
        found += [
            ref
            for ref in private_references(path)
            if ref.split(" ", 1)[1] not in allowed.get(path.name, set())
        ]
    assert found == []
    assert len(private_references(SRC / "base" / "private_api.py")) >= 10  # the walk sees them where they are
