"""What a server says it carried, against what a client made it carry: ``GET /metrics`` scraped
from a real ``shard-service serve`` on loopback and parsed with prometheus_client's own parser
(counts by route and status, body bytes with sendfile's, latency histograms, connections, sets by
state; ``--read-auth`` as for /v1/stats), the access log's sizes (the body bytes sent), and the
server paths of ``--x-accel-redirect`` only for the front that proves itself (a real nginx) and
never for a client that reaches the replica directly."""
from __future__ import annotations

import json
import os
import re
import time

import pytest
from helpers.fronts import ACCEL_SECRET, NGINX, Front, accel_flags
from helpers.required import require
from helpers.shardsets import ServiceProcess, http, served_tiny
from prometheus_client.parser import text_string_to_metric_families

from shards.format.manifest import Manifest

TOKEN = "metrics-reader-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FILE_ROUTE = "/v1/datasets/{ref}/{path}"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = served_tiny(tmp_path_factory.mktemp("metrics"), TOKEN)
    shard = Manifest.load(str(root / "tiny")).splits["train"].shards[0]
    return {"root": root, "shard": shard, "data": (root / "tiny" / shard.name).read_bytes()}


@pytest.fixture
def server(env):
    """A server with read auth and its access log, stopped after the test."""
    proc = ServiceProcess("--catalog", str(env["root"] / "catalog.sqlite"), "--token-file",
                          str(env["root"] / "tokens"),
                          "--read-auth", "--access-log")
    try:
        proc.start()
        yield proc
    finally:
        proc.kill(15)


def scrape(url: str) -> dict:
    """(name, labels as a sorted tuple) -> value, for every sample ``GET /metrics`` answers."""
    status, headers, body = http(url, path="/metrics", headers=AUTH)
    assert status == 200 and headers["content-type"].startswith("text/plain"), body[:300]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_a_scrape_counts_the_requests_it_was_sent(env, server):
    """Requests of known routes by route template (never the URL), method and status; the body bytes
    of sendfile responses whole and in ranges; each request once in its route's histogram; the
    catalog's sets; the connection the scrape itself holds; the process that answered."""
    shard, data = env["shard"], env["data"]
    path = f"/v1/datasets/tiny/{shard.name}"
    for _ in range(3):
        assert http(server.url, path=path, headers=AUTH)[2] == data
    assert http(server.url, path=path, headers={**AUTH, "Range": "bytes=0-99"})[0] == 206
    assert http(server.url, path=path)[0] == 401  # no token: refused, and counted as refused
    assert http(server.url, "HEAD", path, headers=AUTH)[0] == 200
    for _ in range(2):
        assert http(server.url, path="/v1/health")[0] == 200
    assert http(server.url, path="/no/such/route")[0] == 404
    assert http(server.url, path="/metrics")[0] == 401  # read access, as /v1/stats
    got = scrape(server.url)
    requests = {labels: v for (name, labels), v in got.items() if name == "shard_service_requests_total"}
    assert requests == {
        (("method", "GET"), ("route", FILE_ROUTE), ("status", "200")): 3,
        (("method", "GET"), ("route", FILE_ROUTE), ("status", "206")): 1,
        (("method", "GET"), ("route", FILE_ROUTE), ("status", "401")): 1,
        (("method", "HEAD"), ("route", FILE_ROUTE), ("status", "200")): 1,
        (("method", "GET"), ("route", "/v1/health"), ("status", "200")): 2,
        (("method", "other"), ("route", "other"), ("status", "404")): 1,
        (("method", "GET"), ("route", "/metrics"), ("status", "401")): 1,
    }, requests
    refusal = len(json.dumps({"error": "this needs Authorization: Bearer TOKEN", "status": 401}))
    assert got["shard_service_sent_bytes_total", (("route", FILE_ROUTE),)] == 3 * len(data) + 100 + refusal
    assert got["shard_service_request_seconds_count", (("route", FILE_ROUTE),)] == 6
    assert got["shard_service_request_seconds_bucket", (("le", "+Inf"), ("route", "/v1/health"))] == 2
    assert got["shard_service_sets", (("state", "ready"),)] == 1
    assert got["shard_service_open_connections", ()] >= 1  # the scrape's own
    assert got["shard_service_catalog_errors_total", ()] == 0
    (process,) = [labels for name, labels in got if name == "shard_service_process"]
    assert dict(process) == {"pid": str(server.proc.pid), "worker": "0", "workers": "1"}


def test_the_access_log_gives_the_body_bytes_sent(env, server):
    """Before: 321 for a shard of 92,160 bytes sent by sendfile (aiohttp's figure: the head, and
    none of what the kernel sent)."""
    shard, data = env["shard"], env["data"]
    path = f"/v1/datasets/tiny/{shard.name}"
    assert http(server.url, path=path, headers=AUTH)[2] == data
    assert http(server.url, path=path, headers={**AUTH, "Range": "bytes=10-59"})[0] == 206
    assert http(server.url, "HEAD", path, headers=AUTH)[0] == 200
    line = re.compile(r' "(GET|HEAD) (\S+) HTTP/1\.1" (\d+) (\d+) ')
    deadline = time.monotonic() + 30  # each line is written once its response has gone out
    while sum(f" {path} " in s for s in server.log) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    logged = [m.groups() for s in server.log if " service.access: " in s and (m := line.search(s))]
    assert logged == [("GET", path, "200", str(len(data))), ("GET", path, "206", "50"),
                      ("HEAD", path, "200", "0")]


@pytest.fixture(scope="module")
def replica(env, tmp_path_factory):
    """A replica handing files to a real nginx in front of it (the shipped configuration)."""
    require("nginx", None if os.path.exists(NGINX) else f"{NGINX} missing: scripts/test.sh installs Debian's "
                                                        f"nginx-light")
    prefix = tmp_path_factory.mktemp("front")
    proc = ServiceProcess("--catalog", str(env["root"] / "catalog.sqlite"), *accel_flags(str(prefix)))
    front = None
    try:
        proc.start()
        front = Front(prefix, [proc.url.split("//")[1]])
        yield proc, front.start()
    finally:
        if front is not None:
            front.stop()
        proc.kill(15)


def test_only_the_front_that_proves_itself_gets_a_server_path(env, replica):
    """Before: any client that reached a replica and sent ``X-Sendfile-Type: X-Accel-Redirect``
    got ``X-Accel-Redirect`` and ``X-Accel-Root``: absolute paths of the server's disks."""
    proc, front = replica
    shard, data = env["shard"], env["data"]
    path = f"/v1/datasets/tiny/{shard.name}"
    handed = lambda: json.loads(http(proc.url, path="/v1/stats")[2])["total"]["accel_redirects"]  # noqa: E731
    for secret in ({}, {"X-Accel-Secret": "not-" + ACCEL_SECRET}, {"X-Accel-Secret": ACCEL_SECRET[:-1]}):
        status, headers, body = http(proc.url, path=path, headers={"X-Sendfile-Type": "X-Accel-Redirect",
                                                                   **secret})
        assert status == 200 and body == data, secret
        assert not [h for h in headers if h.startswith("x-accel")] and str(env["root"]).encode() not in body
    assert handed() == 0
    status, headers, body = http(front.url, path=path)  # nginx, sending the secret: handed the file, sends it
    assert status == 200 and body == data and headers["etag"] == f'"{shard.sha256}"'
    assert not [h for h in headers if h.startswith("x-accel")]
    assert handed() == 1
    status, headers, _ = http(proc.url, path=path, headers={"X-Sendfile-Type": "X-Accel-Redirect",
                                                            "X-Accel-Secret": ACCEL_SECRET})
    assert status == 200 and headers["x-accel-root"] == str(env["root"] / "tiny") and handed() == 2
