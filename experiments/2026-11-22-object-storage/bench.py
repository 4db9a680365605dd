"""Upload and verified download of one checkpoint-sized file through lm.checkpoint.remote against moto on loopback.

PYTHONPATH=src python experiments/2026-11-22-object-storage/bench.py 256
"""

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from moto.server import ThreadedMotoServer

from lm.checkpoint.files import loadable
from lm.checkpoint.remote import RemoteCheckpoints

mb = int(sys.argv[1]) if len(sys.argv) > 1 else 256
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
os.environ.update(
    AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1",
    AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_EC2_METADATA_DISABLED="true",
)  # fmt: skip
logging.getLogger("werkzeug").setLevel(logging.ERROR)
store = RemoteCheckpoints("s3://bench/run/checkpoints", keep_last=2)
store.fs.mkdir("bench")
with tempfile.TemporaryDirectory() as d:
    src = Path(d) / "step-1.ckpt"
    n = mb * 2**20 // 4
    torch.save(
        {"state_dict": {"w": torch.randn(n)}, "optimizer_states": [], "global_step": 1, "loops": {}}, src
    )
    size = src.stat().st_size
    for step in (1, 2, 3):  # the third upload also rotates step 1 out
        t0 = time.perf_counter()
        with open(src, "rb") as f:
            store.upload(f, step)
        up = time.perf_counter() - t0
        print(
            f"upload step {step}: {size / 1e6:.0f} MB in {up:.2f} s = {size / 1e6 / up:.0f} MB/s (incl. pointer + rotation)"
        )
    t0 = time.perf_counter()
    got = store.download_newest(Path(d) / "machine-b", loads=loadable)
    down = time.perf_counter() - t0
    print(
        f"verified download (size, sha256, load check): {size / 1e6:.0f} MB in {down:.2f} s = {size / 1e6 / down:.0f} MB/s -> {got.name}"
    )
server.stop()
