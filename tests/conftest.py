"""Fixtures: the real Hydra config, composed for a CPU, a tiny model and temporary folders; a module's runs folder;
an S3 server."""

from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from lm.config import register_configs
from lm.run.train import main

from .helpers import BUCKET, S3Server

CONF = Path(__file__).resolve().parents[1] / "conf"

# A model and corpus small enough that a training step takes milliseconds on one CPU core.
TINY = [
    "trainer=cpu",
    "trainer.enable_progress_bar=false",
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=4",
    "data.max_bytes=1500000",
    "data.tokenizer_sample_bytes=500000",
    "data.vocab_size=512",
    "data.seq_len=64",
    "data.batch_size=8",
    "data.num_workers=2",
    "logger=tensorboard",
    "callbacks={}",
    "sampling.max_new_tokens=16",  # milestone samples stay on in every run, at a quarter of the default cost
]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One prepared-data cache for the whole session: the tokenizer is trained once."""
    return tmp_path_factory.mktemp("lm-cache")


@pytest.fixture(scope="module")
def root(request, tmp_path_factory) -> Path:
    """The runs folder a test module's tests share (its reference run, and the cases compared with it)."""
    return tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])


@pytest.fixture(scope="module")
def s3_server():
    """An S3-compatible server (moto) on loopback with the bucket `BUCKET`, which a test may stop and start
    again; one per test module."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = S3Server()
    # moto keeps its buckets in one in-process backend, shared by every server a test process starts: a module
    # that ran before (tests/store/test_object_storage.py) left `BUCKET` and its objects there. Start clean.
    import requests

    requests.post(f"http://{server.host}:{server.port}/moto-api/reset", timeout=30).raise_for_status()
    server.fs().mkdir(BUCKET)
    yield server
    server.stop()


@pytest.fixture
def compose(tmp_path, data_cache):
    """compose(*overrides) -> the config `python train.py *overrides` would run, with outputs in tmp_path."""
    register_configs()

    def _compose(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose(
                "train",
                overrides=[f"run.root={tmp_path / 'runs'}", f"data.cache_dir={data_cache}", *overrides],
            )

    return _compose


@pytest.fixture
def tiny_cfg(compose):
    """compose for a tiny CPU run: tiny_cfg('trainer.max_steps=20', ...)."""
    return lambda *overrides: compose(*TINY, *overrides)


def train_in_process(args: list[str]) -> int:
    """`python train.py *args` in this process; the exit code it would leave with."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose("train", overrides=args)
    try:
        main(cfg)
    except SystemExit as e:
        return e.code
    return 0
