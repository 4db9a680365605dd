"""Checkpoints and data on object storage, against a real S3-compatible server (moto) on loopback.

The run that matters: killed, its machine gone (the local run directory deleted), resumed elsewhere from
the bucket, and still bitwise equal to a run that was never interrupted.
"""

import http.server
import importlib.util
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lm.base.exits import EXIT_CONFIG, EXIT_PREEMPTED, EXIT_SAVE_FAILED, EXIT_UNAVAILABLE, Refused, exit_code
from lm.checkpoint.checkpointer import archive_run, find_resume_point
from lm.checkpoint.remote import POINTER, CheckpointUploader, RemoteCheckpoints, RemoteError
from lm.config import to_objects
from lm.run.train import main
from lm.store.objects import check_writable, retrying, transient

from ..conftest import TINY
from ..conftest import train_in_process as train
from ..faults import saver
from ..harness import ROOT, assert_matches_reference, command, fault, last, overrides
from ..helpers import BUCKET, moto_server, pointer_steps, sha256

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def s3(s3_server):
    """The bucket's filesystem, with the server's fake credentials in the environment (for in-process runs)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env.items():
            mp.setenv(k, v)
        yield s3_server.fs()


def run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`python train.py *args` in a fresh process (a machine of its own), like test_stop_signals' train_process."""
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
        env=env,
    )


@pytest.mark.slow
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
    ckpt = find_resume_point(machine, remote=store)
    assert ckpt is not None and torch.load(ckpt, weights_only=False)["global_step"] == 12

    # The newest listed object is damaged in the bucket: its sha256 fails and the older one is used.
    newest = store.read_pointer()[0]
    s3.pipe_file(f"{BUCKET}/unit/checkpoints/{newest.file}", b"x" * newest.size)
    machine = tmp_path / "machine-b"
    ckpt = find_resume_point(machine, remote=store)
    assert torch.load(ckpt, weights_only=False)["global_step"] == 6
    assert not list((machine / "checkpoints").glob("*tmp*"))  # the refused download left nothing behind

    # A local checkpoint newer than the bucket's wins; nothing is downloaded.
    ckpt = find_resume_point(tmp_path / "machine-a", remote=store)
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
    assert archive_run(tmp_path / "machine-c", remote=store) is None
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
        with caplog.at_level(logging.ERROR, logger="lm.checkpoint.remote"):
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
    with pytest.raises(Refused, match="upload_timeout_s=0.0 must be > 0"):
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
    with pytest.raises(Refused, match=message):
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


# -- which run a remote folder belongs to -------------------------------------------------------------------


def identity(**changes) -> dict:
    base = {"run.name": "shared", "run.root": "runs", "run.seed": 0, "model.d_model": 64}
    return base | changes


def test_a_remote_folder_is_claimed_by_one_run(s3, tmp_path):
    url = f"s3://{BUCKET}/claim/checkpoints"
    first = RemoteCheckpoints(url)
    assert first.claim(None, identity()) and first.read_pointer() == []  # an empty folder: a new id
    with open(fake_checkpoint(tmp_path / "2.ckpt", 2), "rb") as f:
        first.upload(f, 2)
    theirs = first.run_id

    # The same run: its own directory, or a new machine (no run.json) with the same identity.
    assert RemoteCheckpoints(url).claim(theirs, identity()) == theirs
    assert RemoteCheckpoints(url).claim(None, identity()) == theirs
    # Another run: its directory has another id, or a fresh one has another identity. Named, with the fixes.
    with pytest.raises(
        RemoteError, match=rf"belongs to run abc.*holds run {theirs}.*checkpoint.run_id={theirs}"
    ):
        RemoteCheckpoints(url).claim("abc", identity())
    with pytest.raises(RemoteError, match=r"run.root 'runs' there, '/elsewhere' here.*another run.name"):
        RemoteCheckpoints(url).claim(None, identity(**{"run.root": "/elsewhere"}))
    # An explicit checkpoint.run_id adopts the bucket's run whatever the config; a wrong one is refused.
    assert RemoteCheckpoints(url).claim(None, identity(**{"model.d_model": 128}), explicit=theirs) == theirs
    with pytest.raises(RemoteError, match=rf"checkpoint.run_id=nope, but .* holds run {theirs}"):
        RemoteCheckpoints(url).claim(None, identity(), explicit="nope")

    # A pointer written before run ids is continued as before and gets the run's id at the next upload.
    old = json.loads(s3.cat_file(f"{BUCKET}/claim/checkpoints/{POINTER}"))
    del old["run_id"], old["identity"]
    s3.pipe_file(f"{BUCKET}/claim/checkpoints/{POINTER}", json.dumps(old).encode())
    store = RemoteCheckpoints(url)
    assert store.claim("mine", identity(**{"run.root": "/elsewhere"})) == "mine"
    with open(fake_checkpoint(tmp_path / "4.ckpt", 4), "rb") as f:
        store.upload(f, 4)
    assert store.read_doc()["run_id"] == "mine"


def test_another_run_with_the_same_name_is_refused_and_a_new_machine_still_resumes(s3, tmp_path, data_cache):
    remote = f"checkpoint.remote=s3://{BUCKET}/runs-ab"
    a = overrides(tmp_path / "a", data_cache, "same", "sampling=off", remote, "trainer.max_steps=4")
    assert train(a) == 0
    key = f"{BUCKET}/runs-ab/same/checkpoints/{POINTER}"
    pointer = s3.cat_file(key)
    run_id = json.loads(pointer)["run_id"]
    assert run_id == json.loads((tmp_path / "a/same/run.json").read_text())["run_id"]

    # Run B: another run.root, the same run.name and checkpoint.remote. Refused before anything is downloaded.
    b = overrides(tmp_path / "b", data_cache, "same", "sampling=off", remote, "trainer.max_steps=4")
    with pytest.raises(RemoteError) as refusal:
        train(b)
    assert exit_code(refusal.value) == EXIT_CONFIG
    assert f"holds another run's checkpoints (run {run_id}" in str(refusal.value)
    assert f"run.root '{tmp_path / 'a'}' there, '{tmp_path / 'b'}' here" in str(refusal.value)
    assert not (tmp_path / "b/same/checkpoints").exists()
    s3.invalidate_cache()
    assert s3.cat_file(key) == pointer  # A's folder untouched

    # A new machine for run A (its run directory gone, the same command) adopts the bucket's run and resumes
    # at step 4: nothing left to train, nothing uploaded again.
    shutil.rmtree(tmp_path / "a/same")
    assert train(a) == 0
    assert json.loads((tmp_path / "a/same/run.json").read_text())["run_id"] == run_id
    assert (tmp_path / "a/same/checkpoints/step-4.ckpt").exists()
    s3.invalidate_cache()
    assert json.loads(s3.cat_file(key))["checkpoints"] == json.loads(pointer)["checkpoints"]


# -- outages and refusals -----------------------------------------------------------------------------------


class S3Error(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that answers every request with one error (throttling, a 5xx, access denied)."""

    status, code = 503, "SlowDown"

    def do_any(self) -> None:
        body = f"<Error><Code>{self.code}</Code><Message>{self.code}</Message></Error>".encode()
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:  # no body: the status alone
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_POST = do_DELETE = do_any

    def log_message(self, *args) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_at(port: int):
    import s3fs

    fs = s3fs.S3FileSystem(
        skip_instance_cache=True,
        endpoint_url=f"http://127.0.0.1:{port}",
        config_kwargs={"retries": {"max_attempts": 1}},
    )
    fs.retries = 1  # one attempt: the classification is under test, not the clients' own retries
    return fs


def raised(call) -> BaseException:
    try:
        call()
    except Exception as e:
        return e
    raise AssertionError("no exception")


@pytest.mark.parametrize(
    ("status", "code", "is_transient"),
    [
        (503, "SlowDown", True),
        (500, "InternalError", True),
        (429, "TooManyRequests", True),
        (403, "AccessDenied", False),
    ],
)
def test_error_responses_are_told_apart(s3, status, code, is_transient):
    handler = type("Handler", (S3Error,), {"status": status, "code": code})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fs = s3_at(server.server_address[1])
        assert transient(raised(lambda: fs.cat_file(f"{BUCKET}/x"))) is is_transient
        t0 = time.monotonic()
        error = raised(
            lambda: retrying(lambda: fs.cat_file(f"{BUCKET}/x"), "s3://b/x", "reading", window_s=0.5)
        )
        assert exit_code(error) == (EXIT_UNAVAILABLE if is_transient else EXIT_CONFIG)
        assert time.monotonic() - t0 < 30
        if not is_transient:
            assert "access denied" in str(error)
    finally:
        server.shutdown()


def test_no_bucket_is_a_refusal_and_a_refused_connection_an_outage(s3):
    missing = raised(lambda: s3.cat_file(f"no-such-{BUCKET}/x"))  # NoSuchBucket from moto, through s3fs
    assert not transient(missing)
    with pytest.raises(RemoteError, match="the bucket does not exist"):
        check_writable(f"s3://no-such-{BUCKET}/x", window_s=60)  # at once: a refusal is never retried
    refused = raised(lambda: s3_at(free_port()).cat_file(f"{BUCKET}/x"))
    assert transient(refused)
    assert not transient(RemoteError("x")) and not transient(ValueError("x"))


def child_env(endpoint: str) -> dict:
    return {**os.environ, "AWS_ENDPOINT_URL": endpoint}


def wait_for_text(path: Path, text: str, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        assert process.poll() is None and time.monotonic() < deadline, path.read_text()[-3000:]
        time.sleep(0.1)


@pytest.mark.slow
def test_a_store_down_at_start_up_is_waited_for_and_past_the_window_supervise_restarts(
    s3, tmp_path, data_cache
):
    port = free_port()
    env = child_env(f"http://127.0.0.1:{port}")
    args = [
        *TINY,
        f"run.root={tmp_path}",
        f"data.cache_dir={data_cache}",
        "trainer.max_steps=2",
        "sampling=off",
    ]
    remote = f"checkpoint.remote=s3://{BUCKET}/down"

    # Down at start-up, back within the window: the probe waits for it and the run trains.
    out = tmp_path / "first.out"
    cmd = [sys.executable, "train.py", *args, remote, "run.name=first", "checkpoint.retry_window_s=120"]
    with open(out, "w") as stdout:
        child = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = None
    try:
        wait_for_text(out, "retrying for up to 120 s", child)
        server = moto_server(port)
        server.start()
        assert child.wait(timeout=240) == 0, out.read_text()[-3000:]
    finally:
        child.kill()
        if server is not None:
            server.stop()

    # Down past the window: exit 69 soon after it, and `lm supervise` restarts the run until the store is back.
    out = tmp_path / "second.out"
    supervised = command([*args, remote, "run.name=second", "checkpoint.retry_window_s=1"], supervised=True)
    with open(out, "w") as stdout:
        child = subprocess.Popen(
            supervised, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_text(out, "child left with exit 69", child)
        text = out.read_text()
        assert "failed for 1 s" in text and "exit 69" in text and "Traceback" not in text, text[-3000:]
        server = moto_server(port)
        server.start()
        assert child.wait(timeout=240) == 0, out.read_text()[-3000:]
    finally:
        child.kill()
        server.stop()
    assert (tmp_path / "second/checkpoints/step-2.ckpt").exists()


class ResetStore(pl.Callback):
    """Test-only: once step `step`'s checkpoint is in the bucket, the S3 server loses every bucket (moto's
    reset: a server restarted empty)."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.done or trainer.global_step < self.step:
            return
        uploader = saver(trainer).uploader
        deadline = time.monotonic() + 120
        while (uploader.uploaded_step or 0) < self.step and time.monotonic() < deadline:
            time.sleep(0.02)
        request = urllib.request.Request(f"{os.environ['AWS_ENDPOINT_URL']}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=30).close()
        self.done = True


@pytest.mark.slow  # 17-23 s on 2 cores: headroom under the README command's 10 min
def test_a_store_that_lost_its_data_ends_the_run_with_74_and_says_so(s3, tmp_path, data_cache):
    args = [
        *overrides(tmp_path, data_cache, "lost", "sampling=off", "trainer.max_steps=10"),
        "checkpoint.every_n_steps=2",
        f"checkpoint.remote=s3://{BUCKET}/lost",
        "+callbacks.reset._target_=tests.store.test_object_storage.ResetStore",
        "+callbacks.reset.step=4",
    ]
    try:
        result = run(args, child_env(os.environ["AWS_ENDPOINT_URL"]))
    finally:
        s3.invalidate_cache()
        s3.mkdir(BUCKET)  # the other tests' bucket
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_SAVE_FAILED, output[-3000:]
    said = f"s3://{BUCKET}/lost/lost/checkpoints does not hold this run's latest checkpoint, step 10"
    assert output.count(said) == 1, output[-3000:]
    for step in (6, 8, 10):  # every failed upload: one line, with the cause
        assert output.count(f"uploading step {step} to") == 1 and "bucket does not exist" in output
    assert "Task exception was never retrieved" not in output and "Traceback" not in output
    report = (tmp_path / "lost/report.md").read_text()
    assert "The bucket is behind" in report and "does not hold step 10" in report


def test_an_upload_during_an_outage_is_retried_until_the_store_is_back(s3, tmp_path, caplog):
    port = free_port()
    store = RemoteCheckpoints(
        f"s3://{BUCKET}/outage/checkpoints",
        storage_options={"endpoint_url": f"http://127.0.0.1:{port}", "skip_instance_cache": True},
        retry_window_s=120,
    )
    uploader = CheckpointUploader(store)
    server = moto_server(port)
    with caplog.at_level(logging.INFO):
        uploader.submit(fake_checkpoint(tmp_path / "6.ckpt", 6), 6)  # the server is down
        deadline = time.monotonic() + 60
        while "retrying for up to 120 s" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        server.start()  # back within the window (the same data: moto keeps it across servers)
        try:
            assert uploader.wait(timeout=120)
        finally:
            server.stop()
    assert uploader.uploaded_step == 6 and uploader.failed is None
    assert pointer_steps(s3, f"{BUCKET}/outage/checkpoints") == [6]
    assert caplog.text.count("retrying for up to") == 1 and "succeeded after" in caplog.text


def test_sharded_checkpoints_mirror_file_by_file_and_a_damaged_part_falls_back(s3, tmp_path):
    """checkpoint.format=sharded with a bucket: each file of a folder is an object under one fresh prefix,
    the pointer lists every part's size and sha256; a machine without the run downloads the newest folder
    whole (a damaged part refuses it and the older folder is used); rotation deletes whole prefixes."""
    from lm.checkpoint import files

    from ..checkpoint.test_sharded import save

    url = f"s3://{BUCKET}/sharded/checkpoints"
    uploader = CheckpointUploader(RemoteCheckpoints(url, keep_last=2))
    local = tmp_path / "run" / "checkpoints"
    for step in (4, 8):
        folder = save(local, step)
        uploader.submit(folder, step)
        shutil.rmtree(folder)  # rotation right after the submit: the open files are what uploads
        assert uploader.wait(timeout=120) and uploader.failed is None, uploader.failed
    store = uploader.store
    newest = store.read_pointer()[0]
    assert newest.step == 8 and [p["name"] for p in newest.parts] == [".metadata", "__0_0.distcp", "meta.pt"]
    assert newest.size == sum(p["size"] for p in newest.parts)

    machine = tmp_path / "machine-a"
    ckpt = find_resume_point(machine, remote=store)
    assert ckpt is not None and files.is_sharded(ckpt.resolve()) and files.read(ckpt)["global_step"] == 8
    assert store.holds(8, sum(p.stat().st_size for p in ckpt.resolve().iterdir())) is None

    # One part of the newest folder damaged in the bucket: its sha256 fails, the folder is refused whole.
    s3.pipe_file(f"{BUCKET}/sharded/checkpoints/{newest.file}/meta.pt", b"x" * newest.parts[2]["size"])
    machine = tmp_path / "machine-b"
    ckpt = find_resume_point(machine, remote=store)
    assert files.read_meta(ckpt)["global_step"] == 4
    assert not list((machine / "checkpoints").glob("*tmp*"))  # the refused download left nothing behind

    # A third upload rotates the oldest folder away: every object under its prefix goes.
    uploader.submit(save(local, 12), 12)
    assert uploader.wait(timeout=120)
    assert [e.step for e in store.read_pointer()] == [12, 8]
    left = {p.rsplit("/", 1)[1] for p in s3.ls(f"{BUCKET}/sharded/checkpoints", refresh=True)}
    assert left == {POINTER, *(e.file for e in store.read_pointer())}
