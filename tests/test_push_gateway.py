"""``trainer train --push-gateway URL`` (trainer/prometheus.py) against a real Prometheus Pushgateway:
Debian's ``prometheus-pushgateway`` (scripts/test.sh installs it), started on a free loopback port,
its persistence file in the test's directory, stopped on every path.

A real run reads its set from ``shard-service serve`` over HTTP: the service is started only once
the run has said it is waiting for it (an outage the run's reads meet), and one training sample's
bytes are damaged (left out under ``--max-bad-samples 1``). Once the run has ended, the gateway's
``/metrics``, read with prometheus_client's text parser, holds the run's figures under its job,
``run`` and ``rank``: the steps and clips its metrics.jsonl records, a data wait and a step time for
every step, the bad sample, the outage its manifest read waited out. A gateway that cannot be
reached costs the run one warning line. (A flag that is not an http:// URL: tests/test_newcomer.py.)
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from helpers.fronts import free_port
from helpers.required import require
from helpers.shardsets import ServiceProcess, corrupt_sample, make_shardset, register
from prometheus_client.parser import text_string_to_metric_families

from shards.catalog import Catalog
from trainer import metrics
from trainer.prometheus import JOB, PushGateway

GATEWAY = "/usr/bin/prometheus-pushgateway"
CLIPS, BATCH = 8, 2
FLAGS = ["--backend", "none", "--segments", "4", "--depth", "10", "--width", "4", "--crop-size", "24",
         "--scale-size", "28", "--batch-size", str(BATCH), "--warmup-epochs", "0", "--workers", "1",
         "--print-freq", "1", "--no-tensorboard", "--epochs", "1", "--val-split", "", "--max-bad-samples",
         "1"]


@pytest.fixture
def gateway(tmp_path):
    require("pushgateway", None if os.path.exists(GATEWAY) else
            f"{GATEWAY} missing: scripts/test.sh installs Debian's prometheus-pushgateway")
    port = free_port()
    proc = subprocess.Popen([GATEWAY, f"--web.listen-address=127.0.0.1:{port}",
                             f"--persistence.file={tmp_path / 'pushgateway.data'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the pushgateway never answered"
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def pushed(url: str, run: str) -> dict[str, dict[tuple, float]]:
    """The gateway's samples of ``run``'s rank 0, by name, each keyed by its other labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            if labels.pop("job", None) == JOB and labels.pop("run",
                                                             None) == run and labels.pop("rank", None) == "0":
                labels.pop("instance", None)
                out.setdefault(s.name, {})[tuple(sorted(labels.items()))] = s.value
    return out


@pytest.mark.long  # a training run and a service: about 20 s on 2 cores
def test_a_run_pushes_its_figures_to_a_real_pushgateway(gateway, tmp_path):
    data = tmp_path / "clips"
    make_shardset(str(data), {"train": CLIPS}, per_shard=4, frames=4, size=(32, 28))
    corrupt_sample(data, "train", 1, 2, at=600, nbytes=40, mask=0xFF)
    catalog = tmp_path / "catalog.db"
    register(Catalog(str(catalog)), str(data), "clips")
    port, out = free_port(), tmp_path / "run-a"
    run = subprocess.Popen([sys.executable, "-m", "trainer", "train", "--data",
                            f"http://127.0.0.1:{port}/v1/datasets/clips", "--output-dir", str(out), *FLAGS,
                            "--push-gateway", gateway], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(run.stdout), daemon=True)
    reader.start()
    service = ServiceProcess("--catalog", str(catalog), "--port", str(port))
    try:
        deadline = time.monotonic() + 120
        # its manifest read waits for the service
        while not any("is not answering" in line for line in output):
            assert run.poll() is None and time.monotonic() < deadline, "".join(output)
            time.sleep(0.05)
        service.start()
        assert run.wait(timeout=600) == 0, "".join(output)[-3000:]
    finally:
        run.kill()
        reader.join(timeout=60)
        service.kill()
    steps = [r for r in metrics.read(str(out / "metrics.jsonl")) if r["event"] == "train"]
    figures = pushed(gateway, "run-a")
    assert figures["kf_trainer_steps_total"][()] == len(steps) == CLIPS // BATCH
    assert figures["kf_trainer_clips_total"][()] == CLIPS - 1  # the bad sample never trained
    assert (figures["kf_trainer_data_wait_seconds_count"][()] == figures["kf_trainer_step_seconds_count"][()]
            == len(steps))
    assert figures["kf_trainer_bad_samples_total"] == {(("split", "train"),): 1}
    assert figures["kf_trainer_source_outages_total"][()] >= 1
    assert figures["kf_trainer_source_outage_seconds_total"][()] > 0
    assert figures["kf_trainer_clips_per_second"][()] > 0 and figures["kf_trainer_epoch"][()] == 1
    assert figures["kf_trainer_loss"][()] > 0


def test_a_gateway_that_cannot_be_reached_costs_one_line(caplog):
    hook = PushGateway(f"http://127.0.0.1:{free_port()}", "run-b", 0, every=1)
    with caplog.at_level(logging.WARNING, logger="trainer.prometheus"):
        hook._push()
        hook.close()  # its final push fails as well
    lines = [r.getMessage() for r in caplog.records]
    assert (len(lines) == 1
            and lines[0].startswith(f"--push-gateway {hook.url}: the figures could not be pushed")), lines
