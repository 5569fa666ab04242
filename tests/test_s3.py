"""A shard set on S3: moto's S3 server on loopback, started here, read through s3fs. Ingest into
s3://, verify it, read its ranges with no metadata request, serve it through the service and
train a step from that."""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys

import pytest
from helpers import media
from helpers.shardsets import ServiceProcess

from ingest import registry
from ingest.clips import ClipConfig
from shards.catalog import Catalog
from shards.format.manifest import Manifest
from shards.read.reading import read_range
from shards.tools.verify import verify


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set at import, before the session's Ray starts: its workers (which write the shards) inherit it.
PORT = _free_port()
ENDPOINT = f"http://127.0.0.1:{PORT}"
os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": ENDPOINT})
BUCKET = "kf-shards"


class Requests(logging.Handler):
    """The request lines moto's server logs: (method, path)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def emit(self, record):
        m = re.search(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP', record.getMessage())  # colours or not
        if m:
            self.seen.append((m[1], m[2]))


@pytest.fixture(scope="module")
def s3(ray_local):
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=PORT, verbose=False)
    server.start()
    requests = Requests()
    logging.getLogger("werkzeug").addHandler(requests)
    logging.getLogger("werkzeug").setLevel(logging.INFO)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(endpoint_url=ENDPOINT)
    fs.mkdir(BUCKET)
    yield fs, requests
    logging.getLogger("werkzeug").removeHandler(requests)
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def test_ingest_into_s3_verify_serve_and_train(s3, tmp_path):
    fs, requests = s3
    src = tmp_path / "videos"
    for label in ("jump", "walk"):
        for i in range(2):
            media.make_video(src / "train" / label / f"{label}{i}.mp4", frames=16, width=40, height=30)
    catalog = str(tmp_path / "catalog.sqlite")
    url = f"s3://{BUCKET}/tiny"
    summary, rec = registry.build(catalog, str(src), url, ClipConfig(frames=4, short_side=30),
                                  splits=("train",), shard_samples=2, workers=2, videos_per_task=2)
    assert rec.state == "ready" and rec.location == url and summary.clips == 4
    assert sorted(fs.ls(f"{BUCKET}/tiny/train")) == [f"{BUCKET}/tiny/train/train-00000{i}.tar"
                                                     for i in (0, 1)]
    m = Manifest.load(url)
    assert verify(m) == []

    requests.seen.clear()
    shard = m.splits["train"].shards[1]
    raw = fs.cat_file(f"{BUCKET}/tiny/{shard.name}")
    for i in range(shard.num_samples):  # ranges without a HEAD: the manifest gave the sizes
        a, b = shard.offsets[i], shard.offsets[i] + shard.lengths[i]
        assert read_range(m.shard_url(shard), a, b) == raw[a:b]
    shard_requests = [method for method, path in requests.seen if path.endswith(shard.name)]
    assert shard_requests.count("HEAD") == 0 and shard_requests.count("GET") == 1 + shard.num_samples

    server = ServiceProcess("--catalog", catalog)
    base = server.start()
    try:
        data = f"{base}/v1/datasets/{rec.id}"
        # streamed from S3
        assert read_range(f"{data}/{shard.name}", 100, 5000) == raw[100:5000], "".join(server.log)
        out = tmp_path / "run"
        proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--data", data,
                               "--output-dir", str(out), "--val-split", "", "--segments", "4",
                               "--depth", "10", "--width", "8", "--crop-size", "24", "--scale-size", "28",
                               "--batch-size", "2", "--epochs", "1", "--warmup-epochs", "0", "--workers", "1",
                               "--print-freq", "1", "--no-tensorboard", "--backend", "none"],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                 if line.strip()]
        assert max(s.get("step", 0) for s in steps) == 2  # 4 clips, batches of 2
    finally:
        server.kill(15)
    assert Catalog(catalog).get(rec.id).state == "ready"
