"""A PostgreSQL outage of over a minute, after a catalog write, under a training run that reads
through nginx (long stage): two ``shard-service serve`` replicas on one PostgreSQL catalog behind
the shipped docker/nginx-replicas.conf, all real and on loopback.

* A two-rank run (``horovodrun -np 2 --gloo``) is held at rank 0's first step; a tag is put through
  nginx (a catalog write: the replica that makes it sees its own commit at once, the other by its
  notification), PostgreSQL is stopped, the run let go; at its fourth step it is held until the
  catalog has been down 65 s, nginx asked for a shard every second meanwhile, then let go to read
  the rest of epoch 1 and all of epoch 2 (its loader's reads start with the epoch), its source
  deadline cut to 30 s. Every read is answered:
  each replica's ``GET /metrics`` (read with prometheus_client's parser) counts only 2xx on the
  data routes over the outage, nginx answered every probe 200, the trainer never waited for its
  source; each replica logged once that it serves from its last known records. The run's weights
  at every step and at the end are bitwise equal to an undisturbed run's. Red with the records'
  stale-safe serving off (``service.records``: every unconfirmed record refused at once): both
  replicas answer 503, and nginx answers 503, then 502 (no live upstream).
* ``--catalog-staleness`` honoured: a replica with a 2 s bound serves a set it knows from its last
  known record after its own write while the catalog is down, refuses a set it never looked up,
  and past the bound answers 503 (``Retry-After``) with one log line naming the bound; once the
  catalog is back it answers 200 again.
"""
from __future__ import annotations

import signal
import time

import pytest
from helpers.fronts import accel_flags
from helpers.postgres import PostgresServer
from helpers.replica_runs import CLIPS, HeldRun, Replica, assert_trained_alike, replicated, train
from helpers.shardsets import http, make_shardset, register
from prometheus_client.parser import text_string_to_metric_families

from shards.catalog import Catalog
from shards.format.manifest import Manifest

pytestmark = pytest.mark.long
TOKEN = "replica-outage-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DATA_ROUTES = ("/v1/datasets/{ref}", "/v1/datasets/{ref}/{path}")


class CatalogServer:
    """The module's PostgreSQL, stopped and started by the tests (``down`` in between)."""

    def __init__(self):
        self.server, self.down = PostgresServer(), False

    def stop(self) -> None:
        self.server.stop()
        self.down = True

    def start(self) -> None:
        if self.down:
            self.server.start()
            self.down = False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("outage")
    (root / "tokens").write_text(TOKEN + "\n")
    make_shardset(str(root / "clips"), {"train": CLIPS}, per_shard=4, frames=4, size=(48, 40))
    db = CatalogServer()
    try:
        url = db.server.start().database()
        register(Catalog(url), str(root / "clips"), "clips")
        args = ("--catalog", url, "--token-file", str(root / "tokens"))
        shards = Manifest.load(str(root / "clips")).splits["train"].shards
        with replicated(root, *args, *accel_flags(str(root))) as (replicas, front):
            yield {"db": db, "url": url, "args": args, "replicas": replicas, "front": front, "shards": shards}
    finally:
        db.start()
        db.server.close()


def data_reads(replica: Replica) -> dict[str, float]:
    """The requests ``replica`` answered on the data routes so far, by status (its ``GET /metrics``)."""
    status, _, body = http(replica.url, path="/metrics")
    assert status == 200, body
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "shard_service_requests_total" and sample.labels["route"] in DATA_ROUTES:
                counts[sample.labels["status"]] = counts.get(sample.labels["status"], 0) + sample.value
    return counts


def test_a_two_rank_run_reads_through_nginx_through_a_catalog_outage_of_over_a_minute_after_a_write(
        cluster, tmp_path):
    front, replicas, db = cluster["front"], cluster["replicas"], cluster["db"]
    data, shard = f"{front.url}/v1/datasets/clips", cluster["shards"][0].name
    keys = [k for s in cluster["shards"] for k in s.keys]
    calm = train(data, tmp_path / "calm")
    calm_log, _ = calm.communicate(timeout=600)
    assert calm.returncode == 0, calm_log[-3000:]

    marks = [len(r.log) for r in replicas]
    # the hold (SIGSTOP) counts against Gloo's wait in a collective under way: its 30 s default raised
    run = HeldRun(data, tmp_path / "outage", [1, 4], {"SHARD_SOURCE_DEADLINE": "30",
                                                      "HOROVOD_GLOO_TIMEOUT_SECONDS": "300"})
    try:
        run.held(1)
        status, _, body = http(front.url, "PUT", "/v1/datasets/clips/tags/outage", AUTH)
        assert status in (200, 201), body  # the write: every replica notified
        time.sleep(1)  # a notification takes milliseconds
        db.stop()
        stopped = time.monotonic()
        before = [data_reads(r) for r in replicas]
        run.go_on(1)
        run.held(4)
        probes = []
        while time.monotonic() - stopped < 65:  # down past a minute, nginx asked all along
            probes.append(http(front.url, path=f"/v1/datasets/clips/{shard}")[0])
            time.sleep(1)
        mid = [data_reads(r) for r in replicas]
        run.go_on(4)
        returncode = run.wait()
        after = [data_reads(r) for r in replicas]
        outage = time.monotonic() - stopped
    finally:
        run.kill()
        db.start()
    assert outage > 65 and set(probes) == {200} and len(probes) >= 60, probes
    assert returncode == 0 and "Traceback" not in run.log, run.log[-4000:]
    assert "is not answering" not in run.log  # no read of the run's waited for its source
    for replica, old, new, mark in zip(replicas, before, after, marks):
        answered = {status: n - old.get(status, 0) for status, n in new.items() if n > old.get(status, 0)}
        # read from, every read answered
        assert answered and all(s.startswith("2") for s in answered), answered
        assert sum("serving the sets this replica has looked up from their last known records" in line
                   for line in replica.log[mark:]) == 1, replica.log[mark:]
    assert sum(new.get("200", 0) + new.get("206", 0) - old.get("200", 0) - old.get("206", 0)
               for old, new in zip(mid, after)) > 0  # epoch 2 read with the catalog down over a minute
    assert_trained_alike(tmp_path / "calm", tmp_path / "outage", keys)


def test_a_replica_refuses_past_its_catalog_staleness_with_a_503_and_one_line(cluster):
    db, shard = cluster["db"], cluster["shards"][0].name
    bounded = Replica(*cluster["args"], "--catalog-staleness", "2")
    bounded.start()
    path = f"/v1/datasets/clips/{shard}"
    try:
        assert http(bounded.url, path=path)[0] == 200  # looked up
        status, _, body = http(bounded.url, "PUT", "/v1/datasets/clips/tags/bounded", AUTH)
        assert status in (200, 201), body  # its own write: its record unconfirmed from the next request
        db.stop()
        try:
            assert http(bounded.url, path=path)[0] == 200  # within the bound: its last known record
            status, headers, _ = http(bounded.url, path="/v1/datasets/never-looked-up/x.tar")
            assert status == 503 and headers["retry-after"] == "1"
            time.sleep(2.5)  # past the bound
            mark = len(bounded.log)
            status, headers, body = http(bounded.url, path=path)
            assert status == 503 and headers["retry-after"] == "1", body
            deadline = time.monotonic() + 30
            while not (lines := [line for line in bounded.log[mark:] if path in line]):
                assert time.monotonic() < deadline, bounded.log[mark:]
                time.sleep(0.05)
            assert (len(lines) == 1
                    and "past the staleness bound of 2 s (--catalog-staleness)" in lines[0]), lines
        finally:
            db.start()
        deadline = time.monotonic() + 30  # asked again once its listener is back
        while (status := http(bounded.url, path=path)[0]) != 200:
            assert status == 503 and time.monotonic() < deadline, status
            time.sleep(0.1)
    finally:
        bounded.kill(signal.SIGTERM)
