"""The service's edges that a hostile client or a mistaken operator reaches (docs/faults.md), each
against a real ``shard-service serve`` on 127.0.0.1 whose log (its stderr) is a real file:

* requests aiohttp cannot parse (a 100 kB header line, 10,000 ranges, a 1 MB URL, a bad request
  line...), sent over raw sockets with no token: each answered 4xx by aiohttp and logged as one
  access-log line (with ``--access-log``; none without), never a traceback;
* every route the server registers is a row of a route table (``service.api.routes``), and
  under ``--read-auth`` every route but the open ones (``OPEN``) refuses a request without a
  token, the rows read from the application the server builds, so a route added later is judged
  too; without it, only the write rows refuse; docs/service.md's route rows are those rows;
* a port that another server's ``--workers`` share is refused, not joined.

The one-line refusals at start (a busy port, a catalog typo, ``--read-auth`` without tokens) are
rows of tests/test_newcomer.py.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.shardsets import http, make_shardset, register

from shards.catalog import Catalog

BIN = os.path.dirname(sys.executable)  # the console scripts beside this Python
TOKEN = "edges-token"
HEAD = b"Host: 127.0.0.1\r\n"
# what aiohttp cannot parse -> the bytes of one connection (after a NUL: sent once the rest is answered)
MALFORMED = {
    "a 100 kB header line": b"GET /v1/health HTTP/1.1\r\n" + HEAD + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n",
    "10,000 ranges": b"GET /v1/datasets/tiny/manifest.json HTTP/1.1\r\n" + HEAD + b"Range: bytes="
                     + b",".join(b"%d-%d" % (i, i) for i in range(10_000)) + b"\r\n\r\n",
    "a 1 MB URL": b"GET /" + b"a" * 1_000_000 + b" HTTP/1.1\r\n" + HEAD + b"\r\n",
    "a bad request line": b"GET / HTTP/1.1 and more\r\n" + HEAD + b"\r\n",
    "1,000 headers": b"GET / HTTP/1.1\r\n" + HEAD + b"".join(b"X-%d: y\r\n" % i for i in range(1000))
                     + b"\r\n",
    "a Content-Length not a number": b"POST /v1/builds HTTP/1.1\r\n" + HEAD + b"Content-Length: ten\r\n\r\n",
    "a chunk size not hex": b"POST /v1/builds HTTP/1.1\r\n" + HEAD
                            + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    "a bad method after a good request": b"GET /v1/health HTTP/1.1\r\n" + HEAD
                                         + b"\r\n\0G@T / HTTP/1.1\r\n\r\n",
}
# GET (and HEAD) routes that answer without a token under --read-auth: none holds a set's data
OPEN = {"/v1", "/v1/health", "/v1/viewer", "/", "/sets/{ref}", "/sets/{ref}/clips", "/static/{name}"}


class Server:
    """``shard-service serve --port 0 ARGS`` with its log in ``log_path``; ``stop()`` ends it (SIGTERM)
    and returns the log. The fixture that makes one stops it whatever the test's outcome."""

    def __init__(self, log_path: Path, *args: str):
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([os.path.join(BIN, "shard-service"), "serve", "--port", "0", *args],
                                         stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("serving http://"), log_path.read_text()
        self.url = line.split()[1].rstrip("/")
        self.port = int(self.url.rsplit(":", 1)[1])

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=60)
        return self.log_path.read_text()


@pytest.fixture
def serve(tmp_path):
    """``serve(*args)``: a server on a catalog holding the set ``tiny``, tokens in ``tmp_path/tokens``."""
    make_shardset(str(tmp_path / "tiny"), {"train": 4}, per_shard=2)
    register(Catalog(str(tmp_path / "catalog.sqlite")), str(tmp_path / "tiny"), "tiny")
    (tmp_path / "tokens").write_text(TOKEN + "\n")
    started = []

    def start(*args: str) -> Server:
        log = tmp_path / f"server-{len(started)}.log"
        started.append(Server(log, "--catalog", str(tmp_path / "catalog.sqlite"), "--token-file",
                              str(tmp_path / "tokens"), *args))
        return started[-1]
    yield start
    for server in started:
        server.stop()


def answers(port: int, raw: bytes) -> list[int]:
    """The statuses the server answered on one connection that sent ``raw``, its parts (split at NUL)
    one after the other, each once the answer to the one before has come whole: the last answer
    missing when the server closed the connection before reading all of it (its reset may discard it)."""
    *before, last = raw.split(b"\0")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        data = b""
        try:
            for part in before:
                s.sendall(part)
                while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
                    data += s.recv(1 << 16)
            s.sendall(last)
            while chunk := s.recv(1 << 16):
                data += chunk
        except OSError:  # a reset, or not connected any more, once the server closed
            pass
    return [int(status) for status in re.findall(rb"HTTP/1\.[01] (\d{3}) ", data)]


def _length(data: bytes) -> int:
    """The Content-Length of the (one) answer whose head ``data`` begins with."""
    head = data.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    return int(head.split("content-length:")[1].split()[0])


@pytest.mark.parametrize("access_log", [True, False], ids=["access-log", "no-access-log"])
def test_malformed_requests_are_one_access_log_line_each_never_a_traceback(serve, access_log):
    """25 of each malformed request, with no token. Before: a traceback in the log for most of
    them, 200 requests adding 140 kB."""
    server = serve("--read-auth", *(["--access-log"] if access_log else []))
    sent = 0
    for _ in range(25):
        for what, raw in MALFORMED.items():
            statuses = answers(server.port, raw)
            assert all(400 <= s < 500 for s in statuses[-1:]), (what, statuses)
            assert statuses[:-1] in ([], [200]), (what, statuses)
            sent += 1 + raw.count(b"\0")
    log = server.stop()
    assert "Traceback" not in log and "aiohttp" not in log, log[:3000]
    access = [line for line in log.splitlines() if " service.access: 127.0.0.1 " in line]
    assert len(access) == (sent if access_log else 0), log[:3000]
    assert sum(" 400 " in line for line in access) == (len(MALFORMED) * 25 if access_log else 0)
    assert len(log.splitlines()) - len(access) == 2, log[:3000]  # the start's limits and "stopping"
    assert len(log) < 150 * (len(access) + 2), len(log)


def served_table(tmp_path) -> tuple[list, set]:
    """The rows of the route tables on the application ``serve`` builds (API and viewer), and the
    (method, path) of every route aiohttp registered on it."""
    from service.api.app import make_app
    from service.api.keys import SERVED
    from service.viewer import add_routes

    app = make_app(Catalog(str(tmp_path / "catalog.sqlite")), data_root=str(tmp_path / "sets"))
    add_routes(app)
    registered = {(r.method, r.resource.canonical) for r in app.router.routes()}
    return list(dict.fromkeys(app[SERVED].values())), registered


def test_every_route_is_a_row_and_under_read_auth_only_the_open_ones_answer_without_a_token(serve, tmp_path):
    """Every route of the application ``serve`` builds is a row of a route table (GET with its HEAD),
    the open rows are ``OPEN``, and each route asked without a token answers 401 unless its row is
    open; without ``--read-auth`` only the write rows do. Before: ``GET /v1/stats`` (the pid and
    traffic counters) answered, its handler having forgotten its check."""
    table, registered = served_table(tmp_path)
    methods = {(m, row.pattern): row for row in table
               for m in (("GET", "HEAD") if row.method == "GET" else (row.method,))}
    assert set(methods) == registered and len(registered) > 20
    assert {row.pattern for row in table if row.access == "open"} == OPEN
    assert {row.access for row in table if row.pattern not in OPEN} == {"read", "write"}
    fill = {"ref": "tiny", "path": "manifest.json", "tag": "t", "id": "tiny", "split": "train", "n": "0",
            "t": "0", "name": "viewer.js"}
    read_auth, plain = serve("--read-auth"), serve()
    for (method, path), row in sorted(methods.items()):
        for server, refusing in ((read_auth, ("read", "write")), (plain, ("write",))):
            status, _, body = http(server.url, method, path.format(**fill))
            assert (status == 401) == (row.access in refusing), (server.url, method, path, status, body[:200])
    status, _, _ = http(read_auth.url, path="/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200


def test_the_route_tables_of_docs_service_md_are_the_route_tables(serve, tmp_path):
    """docs/service.md's route rows (`METHOD PATH` | access | answer) are the rows of the tables the
    server registers, and ``GET /v1`` lists those rows."""
    table, _ = served_table(tmp_path)
    rows = {(row.method, row.pattern, row.access) for row in table}
    page = (Path(__file__).parent.parent / "docs" / "service.md").read_text()
    documented = re.findall(r"^\| `(GET|HEAD|PUT|POST|DELETE) (/\S*)` \| (\w+) \|", page, re.M)
    assert len(documented) == len(set(documented)) and set(documented) == rows, set(documented) ^ rows
    listed = json.loads(http(serve().url, path="/v1")[2])["routes"]
    assert {(r["method"], r["path"], r["access"]) for r in listed} == rows and len(listed) == len(rows)


def test_a_port_another_servers_workers_share_is_refused_not_joined(serve, tmp_path):
    """Before: the second server's workers bound the port beside the first's (SO_REUSEPORT lets
    processes of one user do so), and the kernel spread connections over both servers."""
    first = serve("--workers", "2")
    second = subprocess.Popen([os.path.join(BIN, "shard-service"), "serve", "--catalog",
                               str(tmp_path / "catalog.sqlite"), "--port", str(first.port), "--workers", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        _, stderr = second.communicate(timeout=120)
    finally:
        if second.poll() is None:  # it started: it and its workers stopped
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()
    assert second.returncode == 1 and "Traceback" not in stderr, stderr
    assert stderr.splitlines()[-1] == (f"shard-service serve: error: 127.0.0.1:{first.port}: address already "
                                       "in use: another process listens there (stop it, or give another "
                                       "--port; --port 0 takes a free one)")
