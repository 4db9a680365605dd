"""lm.base.private_api: each private name of torch and Lightning lm reaches still does what lm relies on.

Each Lightning name is tested by what it does in a real fit (a release that renames it or changes what it does
fails here, naming it, instead of breaking a stop signal or a failed run's exit); the torch names by what they
compute. And nothing else in src/lm names a framework's private attribute.
"""

import ast
import multiprocessing
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lm.base import private_api
from lm.checkpoint import files

SRC = Path(__file__).resolve().parents[2] / "src" / "lm"


class Tiny(pl.LightningModule):
    """A linear model on random rows: a fit of a few steps in well under a second."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )  # fmt: skip


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank, so Lightning's broadcast runs as it does under torchrun."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_sigterm_broadcast_lightning_makes_before_each_batch_is_the_one_lm_replaces(
    one_rank_group, monkeypatch
):
    # What Lightning's does: broadcast rank 0's SIGTERM flag, read it on the host and stop every rank.
    with monkeypatch.context() as m:
        m.setattr(pl.Trainer, "received_sigterm", property(lambda self: True))
        run = trainer(max_steps=3)
        with pytest.raises(SIGTERMException):
            run.fit_loop.epoch_loop._broadcast_sigterm_tensor()
        private_api.skip_sigterm_broadcast(run)
        run.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # the stand-in: no collective, no host read
    # Lightning's loop calls it before every micro-batch once there is more than one rank: with lm's stand-in
    # in its place, the loop calls the stand-in instead.
    calls = []
    monkeypatch.setattr(private_api, "_no_broadcast", lambda: calls.append(1))
    monkeypatch.setattr(pl.Trainer, "world_size", property(lambda self: 2))
    run = trainer(max_steps=3)
    private_api.skip_sigterm_broadcast(run)
    run.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2))
    assert run.global_step == 3 and len(calls) == 3


class Stop(Exception):
    pass


class ShutDownWorkers(pl.Callback):
    """At step 2: shut the fit's DataLoader workers down through the adapter, note what it saw, and fail."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.alive = [p for p in multiprocessing.active_children() if p.is_alive()]
        private_api.shutdown_data_workers(trainer)
        time.sleep(0.1)
        self.left = [p for p in self.alive if p.is_alive()]
        raise Stop


def test_shutdown_data_workers_stops_the_workers_of_a_running_fit():
    run = trainer(max_steps=5)
    private_api.shutdown_data_workers(run)  # before fit: no loader yet, nothing to do
    seen = ShutDownWorkers()
    run.callbacks.append(seen)
    # persistent, as lm's DataModule makes them (data.persistent_workers): the workers outlive an epoch
    loader = torch.utils.data.DataLoader(
        torch.randn(64, 4), batch_size=2, num_workers=2, persistent_workers=True
    )
    with pytest.raises(Stop):
        run.fit(Tiny(), loader)
    assert len(seen.alive) >= 2 and seen.left == []  # the loop's workers were running, and are gone


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

    dcp.save({"w": torch.arange(6.0), "lr": 0.5}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    whole = private_api.read_sharded_whole(tmp_path / "dcp")
    assert torch.equal(whole["w"], torch.arange(6.0)) and whole["lr"] == 0.5
    # DCP_INDEX_TYPES is every type this torch pickles into an index: it reads back allowing only those.
    index = files.read_index(tmp_path / "dcp")
    assert {k for k in index.state_dict_metadata} == {"w", "lr"}


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
