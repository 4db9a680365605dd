"""Checkpoints and data on object storage, against a real S3-compatible server (moto) on loopback.

The run that matters: killed, its machine gone (the local run directory deleted), resumed elsewhere from
the bucket, and still bitwise equal to a run that was never interrupted.
"""

import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lm.checkpointing import resume_checkpoint
from lm.config import to_objects
from lm.exits import EXIT_CONFIG, EXIT_PREEMPTED
from lm.remote import POINTER, CheckpointUploader, RemoteCheckpoints, RemoteError
from lm.train import main

from .conftest import TINY
from .test_spot import ROOT, assert_matches_reference, fault, last, overrides, train

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "lm-test"


@pytest.fixture(scope="module")
def s3():
    """An S3-compatible server on 127.0.0.1 with fake credentials in the environment; yields its fs."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_EC2_METADATA_DISABLED": "true",  # never wait for an instance-metadata service
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield fs
    server.stop()


def run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`python train.py *args` in a fresh process (a machine of its own), like test_spot's train_process."""
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
        env=env,
    )


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pointer_steps(fs, prefix: str) -> list[int]:
    fs.invalidate_cache()
    store = RemoteCheckpoints(f"s3://{prefix}")
    return [e.step for e in store.read_pointer()]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("object-storage")


def test_killed_run_resumes_on_a_new_machine_from_the_bucket(s3, root, data_cache):
    reference_name, name = "reference", "moved"
    assert train(overrides(root, data_cache, reference_name, "sampling=off")) == 0
    reference = last(root, reference_name)

    markers = root / f"{name}-markers"  # outside the run directory, which the test deletes
    markers.mkdir()
    args = overrides(
        root,
        data_cache,
        name,
        "sampling=off",
        f"checkpoint.remote=s3://{BUCKET}/runs",
        *fault(markers, "sigkill_after_upload", step=8, key="a"),
        *fault(markers, "sigterm", step=15, key="b"),
    )
    prefix = f"{BUCKET}/runs/{name}/checkpoints"

    # 1. SIGKILL mid-run once a checkpoint is in the bucket; the machine is lost with everything on it.
    first = run(args)
    assert first.returncode == -9, first.stderr[-3000:]
    assert pointer_steps(s3, prefix)[0] >= 6
    shutil.rmtree(root / name)

    # 2. A new machine resumes from the bucket; SIGTERM saves step 16, which is uploaded before exit 75.
    assert train(args) == EXIT_PREEMPTED
    assert pointer_steps(s3, prefix)[0] == 16
    shutil.rmtree(root / name)

    # 3. Another new machine finishes the run from step 16.
    assert train(args) == 0
    assert_matches_reference(root, name, reference)
    steps = pointer_steps(s3, prefix)
    assert steps == [20, 18]  # keep_last=2, and rotation removed every object the pointer does not list
    store = RemoteCheckpoints(f"s3://{prefix}")
    newest = store.read_pointer()[0]
    local = (root / name / "checkpoints/last.ckpt").resolve().read_bytes()
    assert newest.sha256 == sha256(local) == sha256(s3.cat_file(f"{prefix}/{newest.file}"))
    assert sorted(p.rsplit("/", 1)[1] for p in s3.ls(prefix)) == sorted(
        [POINTER, *(e.file for e in store.read_pointer())]
    )


def fake_checkpoint(path: Path, step: int) -> Path:
    torch.save(
        {
            "state_dict": {"w": torch.full((4,), float(step))},
            "optimizer_states": [],
            "global_step": step,
            "loops": {},
        },
        path,
    )
    return path


def test_a_partial_upload_is_never_picked_and_a_corrupt_one_falls_back(s3, tmp_path):
    url = f"s3://{BUCKET}/unit/checkpoints"
    store = RemoteCheckpoints(url, keep_last=3)
    for step in (6, 12):
        with open(fake_checkpoint(tmp_path / f"{step}.ckpt", step), "rb") as f:
            store.upload(f, step)
    # A kill during step 18's upload: an object without a pointer update (here, half of one).
    half = fake_checkpoint(tmp_path / "18.ckpt", 18).read_bytes()
    s3.pipe_file(f"{BUCKET}/unit/checkpoints/step-18.0badc0de.ckpt", half[: len(half) // 2])

    machine = tmp_path / "machine-a"
    ckpt = resume_checkpoint(machine, resume=True, remote=store)
    assert ckpt is not None and torch.load(ckpt, weights_only=False)["global_step"] == 12

    # The newest listed object is damaged in the bucket: its sha256 fails and the older one is used.
    newest = store.read_pointer()[0]
    s3.pipe_file(f"{BUCKET}/unit/checkpoints/{newest.file}", b"x" * newest.size)
    machine = tmp_path / "machine-b"
    ckpt = resume_checkpoint(machine, resume=True, remote=store)
    assert torch.load(ckpt, weights_only=False)["global_step"] == 6
    assert not list((machine / "checkpoints").glob("*tmp*"))  # the refused download left nothing behind

    # A local checkpoint newer than the bucket's wins; nothing is downloaded.
    ckpt = resume_checkpoint(tmp_path / "machine-a", resume=True, remote=store)
    assert ckpt.resolve().name == "step-12.ckpt"

    # The next upload rotates: only objects some pointer lists survive, the partial one included.
    store.keep_last = 2
    with open(fake_checkpoint(tmp_path / "24.ckpt", 24), "rb") as f:
        store.upload(f, 24)
    assert [e.step for e in store.read_pointer()] == [24, 12]
    objects = {p.rsplit("/", 1)[1] for p in s3.ls(f"{BUCKET}/unit/checkpoints", refresh=True)}
    assert objects == {POINTER, *(e.file for e in store.read_pointer())}

    # A run that went back to step 12 (step 24 lost) and saves step 18: 18 is the present, 24 is dropped.
    with open(fake_checkpoint(tmp_path / "18b.ckpt", 18), "rb") as f:
        store.upload(f, 18)
    assert [e.step for e in store.read_pointer()] == [18, 12]

    # run.resume=false sets the pointer aside; its checkpoints are kept and never rotated away.
    assert resume_checkpoint(tmp_path / "machine-c", resume=False, remote=store) is None
    assert store.read_pointer() == []
    with open(fake_checkpoint(tmp_path / "6b.ckpt", 6), "rb") as f:
        store.upload(f, 6)
    objects = {p.rsplit("/", 1)[1] for p in s3.ls(f"{BUCKET}/unit/checkpoints", refresh=True)}
    assert len([o for o in objects if o.endswith(".ckpt")]) == 3
    assert len([o for o in objects if o.startswith("archive-")]) == 1


def test_a_hung_upload_does_not_hold_a_stopping_run(s3, tmp_path, caplog):
    import s3fs

    prefix = f"{BUCKET}/hung/checkpoints"
    uploader = CheckpointUploader(RemoteCheckpoints(f"s3://{prefix}"))
    uploader.submit(fake_checkpoint(tmp_path / "6.ckpt", 6), 6)
    assert uploader.wait(timeout=60) and uploader.uploaded_step == 6

    # The network goes dark: a server that accepts connections and never answers.
    with socket.create_server(("127.0.0.1", 0)) as dark:
        uploader.store.fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            endpoint_url=f"http://127.0.0.1:{dark.getsockname()[1]}",
            config_kwargs={"read_timeout": 120, "retries": {"max_attempts": 1}},
        )
        uploader.submit(fake_checkpoint(tmp_path / "12.ckpt", 12), 12)
        t0 = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="lm.remote"):
            finished = uploader.wait(timeout=1.0)
        waited = time.monotonic() - t0
        # teardown's wait after on_exception's: the process is leaving; it does not wait for the same upload again
        t0 = time.monotonic()
        assert not uploader.wait() and time.monotonic() - t0 < 0.5
    # Closing the dark server resets the hung connection: the upload thread fails and logs it.
    assert not finished
    assert 1.0 <= waited < 10, waited
    assert "did not finish in 1 s" in caplog.text and "exiting without step 12" in caplog.text
    assert "still resumes from step 6" in caplog.text
    assert pointer_steps(s3, prefix) == [6]  # the bucket still describes the complete step 6


def test_upload_timeout_must_be_positive(tiny_cfg):
    with pytest.raises(ValueError, match="upload_timeout_s=0.0 must be > 0"):
        to_objects(tiny_cfg("checkpoint.upload_timeout_s=0"))


@pytest.mark.parametrize(
    ("remote", "message"),
    [
        ("bucket/runs", "is not a URL that names a bucket"),
        (f"s3://no-such-{BUCKET}/runs", "the bucket does not exist"),
        ("nosuchproto://x/runs", "Protocol not known"),
        ("s3://", "is not a URL that names a bucket"),
    ],
)
def test_a_bad_remote_is_refused_before_training(s3, tiny_cfg, tmp_path, remote, message):
    cfg = tiny_cfg(f"checkpoint.remote={remote}", "run.name=bad")
    with pytest.raises(ValueError, match=message):
        main(cfg)
    assert not (tmp_path / "runs/bad/checkpoints").exists()


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_a_missing_filesystem_package_names_it(tiny_cfg):
    with pytest.raises(RemoteError, match=r"pip install gcsfs"):
        main(tiny_cfg("checkpoint.remote=gs://bucket/runs"))


def test_missing_credentials_exit_78_before_training(s3, tmp_path, data_cache):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {
        "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    args = [
        *TINY,
        f"run.root={tmp_path}",
        f"data.cache_dir={data_cache}",
        f"checkpoint.remote=s3://{BUCKET}/x",
    ]
    result = run(args, env)
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    assert "no usable credentials" in result.stderr and "AWS_ACCESS_KEY_ID" in result.stderr
    assert not (tmp_path / "smoke/checkpoints").exists()


def test_tokens_from_the_bucket_are_verified_and_a_corrupt_shard_is_refused(s3, tiny_cfg, tmp_path):
    from lm.data import load_manifest, prepare

    url = f"s3://{BUCKET}/tokens"
    # `lm prepare ... data.dir=s3://...`: prepared into the local cache, then uploaded, manifest last.
    local = prepare(to_objects(tiny_cfg(f"data.dir={url}")).data)
    manifest = load_manifest(local)
    shards = [s for split in ("train", "val") for s in manifest["splits"][split]["shards"]]
    for shard in shards:
        assert sha256(s3.cat_file(f"{BUCKET}/tokens/{shard['file']}")) == shard["sha256"]

    # A machine with an empty cache trains from the bucket: downloaded, verified, memory-mapped locally.
    cache = tmp_path / "cache-a"
    train_args = ["data=tokens", f"data.dir={url}", f"data.cache_dir={cache}", "trainer.max_steps=3"]
    cfg = tiny_cfg(*train_args, "trainer.val_every_steps=3", "trainer.limit_val_batches=1", "sampling=off")
    main(cfg)
    mirror = next(cache.glob("remote-tokens-*"))
    assert load_manifest(mirror, verify=True) == manifest

    # A shard corrupted in the bucket (same size) is refused by name, before training, and nothing
    # is trusted: the local mirror gets no manifest.
    target = shards[0]["file"]
    data = bytearray(s3.cat_file(f"{BUCKET}/tokens/{target}"))
    data[100] ^= 0xFF
    s3.pipe_file(f"{BUCKET}/tokens/{target}", bytes(data))
    cfg = tiny_cfg(*train_args[:2], f"data.cache_dir={tmp_path / 'cache-b'}")
    with pytest.raises(RemoteError, match=rf"{target} does not match the manifest \(sha256"):
        prepare(to_objects(cfg).data)
    mirror = next((tmp_path / "cache-b").glob("remote-tokens-*"))
    assert not (mirror / "manifest.json").exists() and not list(mirror.glob(".*tmp*"))
