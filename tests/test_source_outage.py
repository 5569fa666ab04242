"""The range client, the node cache and the manifest read against a real HTTP server on 127.0.0.1
that is down: refusing connections (nothing listens on its port until the test starts it),
answering 503 or 502, or accepting and then saying nothing. A reader waits for it with capped,
jittered exponential backoff and logs one line when the wait starts and one when it ends; past its
deadline it raises ``SourceUnavailable`` (exit status 75) in one line; deterministic failures
(4xx, a file that is not the manifest's) are never waited for. Assertions are on requests, waits
asked for and log lines, never on durations (but for generous bounds)."""
from __future__ import annotations

import contextlib
import hashlib
import http.server
import logging
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.shardsets import make_shardset

from shards.base.errors import SourceUnavailable
from shards.format.manifest import Manifest
from shards.io.http_range import RangeError, Retry
from shards.read.cache import ShardCache
from shards.read.reading import open_range

SIZE = 200_000
BLOB = bytes(range(256)) * (SIZE // 256) + bytes(SIZE % 256)
SHA = hashlib.sha256(BLOB).hexdigest()
QUICK = dict(backoff=0.01, max_backoff=0.04)  # real sleeps, short ones


class Scripted(http.server.BaseHTTPRequestHandler):
    """Answers ranges of BLOB (and files of ``server.files``), the first requests as
    ``server.script`` says: a status to answer with, or "stall" (say nothing until the test ends)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        srv = self.server
        with srv.lock:
            srv.requests.append(self.path)
            action = srv.script.pop(0) if srv.script else "ok"
        if action == "stall":
            srv.release.wait(60)
            self.close_connection = True
            return
        if action != "ok":
            self.send_response(int(action))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = srv.files.get(self.path, BLOB)
        if "Range" not in self.headers:
            return self._reply(200, {}, data)
        a, b = map(int, re.match(r"bytes=(\d+)-(\d+)", self.headers["Range"]).groups())
        self._reply(206, {"Content-Range": f"bytes {a}-{b}/{len(data)}",
                          "ETag": f'"{hashlib.sha256(data).hexdigest()}"'},
                    data[a:b + 1])

    def _reply(self, status, headers, body):
        self.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Source:
    """A server on a fixed port of 127.0.0.1, started and stopped by the test (while it is not
    started, connections to its port are refused)."""

    def __init__(self, script=(), files=None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.script, self.files, self.requests = list(script), files or {}, []
        self.server = None

    def start(self):
        http.server.ThreadingHTTPServer.allow_reuse_address = True
        srv = self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Scripted)
        srv.daemon_threads, srv.lock, srv.release = True, threading.Lock(), threading.Event()
        srv.script, srv.files, srv.requests = self.script, self.files, self.requests
        threading.Thread(target=srv.serve_forever, daemon=True).start()

    def stop(self):
        if self.server is not None:
            self.server.release.set()
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@contextlib.contextmanager
def source(script=(), files=None, started=True):
    src = Source(script, files)
    if started:
        src.start()
    try:
        yield src
    finally:
        src.stop()


class Recorded(Retry):
    """A policy that records each wait asked of it, then sleeps it (and calls ``then(n)`` after the
    n-th: the test's hook to bring a source back at a known point, not a guessed time)."""

    def __init__(self, then=None, **kwargs):
        super().__init__(**kwargs)
        object.__setattr__(self, "waits", [])
        object.__setattr__(self, "then", then)

    def wait(self, seconds):
        self.waits.append(seconds)
        super().wait(seconds)
        if self.then:
            self.then(len(self.waits))


def wait_lines(caplog) -> tuple[list[str], list[str]]:
    """The range client's log lines: waits started, waits ended."""
    said = [r.getMessage() for r in caplog.records if r.name == "shards.io.http_range"]
    return [m for m in said if "is not answering" in m], [m for m in said if "answers again" in m]


def test_a_refusing_source_is_waited_for_with_capped_backoff_and_one_line_each_way(caplog):
    """Nothing listens until the 6th wait; the read then completes. The backoff doubled from 0.01 s
    up to its 0.04 s cap, each pause jittered to half to all of its step."""
    caplog.set_level(logging.INFO)
    with source(started=False) as src:
        retry = Recorded(then=lambda n: n == 6 and src.start(), deadline=60, **QUICK)
        assert open_range(f"{src.url}/blob.tar", 10, 150_010, size=SIZE, sha256=SHA, retry=retry).read() \
            == BLOB[10:150_010]
    steps = [0.01, 0.02, 0.04, 0.04, 0.04, 0.04]
    assert len(retry.waits) == 6 and all(s / 2 <= w <= s for w, s in zip(retry.waits, steps)), retry.waits
    started, ended = wait_lines(caplog)
    assert len(started) == 1 and len(ended) == 1, caplog.text
    assert (started[0].startswith(f"{src.url} is not answering (ConnectionRefusedError: ")
            and "up to 60 s" in started[0])
    assert re.fullmatch(rf"{src.url} answers again, after \d+\.\d s", ended[0])
    assert src.requests == ["/blob.tar"]


@pytest.mark.parametrize("status", ["503", "502", "504", "429", "408"])
def test_a_gateway_or_a_busy_server_is_waited_for(status, caplog):
    caplog.set_level(logging.INFO)
    with source([status] * 6) as src:
        retry = Recorded(deadline=60, **QUICK)
        assert open_range(f"{src.url}/blob.tar", 0, 1000, size=SIZE, sha256=SHA,
                          retry=retry).read() == BLOB[:1000]
    assert len(src.requests) == 7 and len(retry.waits) == 6
    started, ended = wait_lines(caplog)
    assert len(started) == len(ended) == 1 and f"status {status}, expected 206" in started[0]


def test_a_source_that_accepts_and_says_nothing_is_asked_again_after_the_stall_time(caplog):
    caplog.set_level(logging.INFO)
    with source(["stall", "stall"]) as src:
        retry = Recorded(deadline=60, stall=0.3, **QUICK)
        assert open_range(f"{src.url}/blob.tar", 0, 1000, size=SIZE, sha256=SHA,
                          retry=retry).read() == BLOB[:1000]
    assert len(src.requests) == 3 and len(retry.waits) == 2
    started, ended = wait_lines(caplog)
    assert len(started) == len(ended) == 1 and "TimeoutError" in started[0]


def test_past_the_deadline_the_reader_stops_in_one_line_with_status_75(caplog):
    caplog.set_level(logging.INFO)
    with source(["503"] * 10_000) as src:
        retry = Recorded(deadline=0.5, **QUICK)
        with pytest.raises(SourceUnavailable) as stopped:
            open_range(f"{src.url}/blob.tar", 0, 1000, size=SIZE, sha256=SHA, retry=retry).read()
    message = str(stopped.value)
    assert re.fullmatch(rf"{src.url}/blob.tar: bytes 0-999, at byte 0: no answer for \d+ s, past the source "
                        r"deadline of 0.5 s \(--source-deadline, \$SHARD_SOURCE_DEADLINE\); last: status "
                        r"503, expected 206 Partial Content", message), message
    assert stopped.value.status == 75 and stopped.value.resume
    assert 2 < len(src.requests) == len(retry.waits) + 1 < 1000
    assert sum(retry.waits) <= 0.5 + 1e-9  # the last pause is cut to the deadline: one last try there
    started, ended = wait_lines(caplog)
    assert len(started) == 1 and ended == []


@pytest.mark.parametrize("status", ["400", "401", "403", "410"])
def test_a_deterministic_refusal_is_not_waited_for(status, caplog):
    with source([status]) as src:
        retry = Recorded(deadline=60, **QUICK)
        with pytest.raises(RangeError,
                           match=rf"blob.tar: bytes 0-999, at byte 0: status {status}, expected 206"):
            open_range(f"{src.url}/blob.tar", 0, 1000, size=SIZE, sha256=SHA, retry=retry).read()
    assert len(src.requests) == 1 and retry.waits == [] and wait_lines(caplog) == ([], [])


def test_not_found_is_not_waited_for():
    with source(["404"]) as src:
        with pytest.raises(FileNotFoundError, match="blob.tar: not found"):
            open_range(f"{src.url}/blob.tar", 0, 1000, size=SIZE, sha256=SHA,
                       retry=Recorded(deadline=60)).read()
    assert len(src.requests) == 1


def test_a_server_error_is_asked_again_a_few_times_not_waited_for_to_the_deadline():
    with source(["500"] * 100) as src:
        retry = Recorded(deadline=60, attempts=3, **QUICK)
        with pytest.raises(RangeError,
                           match="status 500, expected 206 Partial Content; gave up after 3 attempts"):
            open_range(f"{src.url}/blob.tar", 0, 1000, size=SIZE, sha256=SHA, retry=retry).read()
    assert len(src.requests) == 3


def test_many_readers_waiting_for_one_source_log_one_line_each_way(caplog):
    """Eight ranges read at once by threads of one process (a loader worker's read-ahead and cache
    downloads alike): one line when the source is first found down, one when it answers."""
    caplog.set_level(logging.INFO)
    with source(["503"] * 24) as src:
        retry = Recorded(deadline=60, **QUICK)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: open_range(f"{src.url}/blob.tar", i * 1000, (i + 1) * 1000,
                                                     size=SIZE, sha256=SHA, retry=retry).read(), range(8)))
    assert got == [BLOB[i * 1000:(i + 1) * 1000] for i in range(8)]
    started, ended = wait_lines(caplog)
    assert len(started) == 1 and len(ended) == 1, caplog.text


def test_the_node_cache_waits_and_its_waiters_give_up_with_the_downloader(tmp_path, caplog):
    """A cache download waits through an outage like any reader. When the downloader gives up, the
    process waiting behind it for the same copy gives up too, with the same line and without a
    deadline (or a request) of its own; a later fetch asks again and gets the copy."""
    caplog.set_level(logging.INFO)
    with source(["503"] * 3) as src:
        cache = ShardCache(str(tmp_path / "up"), retry=Recorded(deadline=60, **QUICK))
        assert open(cache.fetch(f"{src.url}/blob.tar", SHA, SIZE), "rb").read() == BLOB
        assert len(src.requests) == 4
    entered = threading.Event()
    with source(["503"] * 10_000) as src:
        directory = str(tmp_path / "down")
        downloader = ShardCache(directory, retry=Recorded(then=lambda n: n == 1 and entered.wait(30),
                                                          deadline=2, **QUICK))
        waiter = ShardCache(directory, retry=Recorded(deadline=60, **QUICK))
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(downloader.fetch, f"{src.url}/blob.tar", SHA, SIZE)
            while not src.requests:  # the downloader holds the copy's lock
                threading.Event().wait(0.01)
            second = pool.submit(lambda: entered.set() or waiter.fetch(f"{src.url}/blob.tar", SHA, SIZE))
            with pytest.raises(SourceUnavailable) as gave_up:
                first.result(timeout=60)
            asked = len(src.requests)
            with pytest.raises(SourceUnavailable) as followed:
                second.result(timeout=60)
        assert (str(followed.value) == str(gave_up.value)
                and "past the source deadline of 2 s" in str(gave_up.value))
        assert len(src.requests) == asked  # the waiter asked nothing
        src.script.clear()
        assert open(waiter.fetch(f"{src.url}/blob.tar", SHA, SIZE), "rb").read() == BLOB  # tried anew, later
    assert sorted(p.name for p in (tmp_path / "down").rglob("*") if p.is_file()) == [f"{SHA}.tar"]


def test_the_manifest_read_waits_for_its_source_and_gives_up_past_the_deadline(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    make_shardset(str(tmp_path / "set"), {"train": 4}, per_shard=2)
    files = {"/manifest.json": (tmp_path / "set" / "manifest.json").read_bytes()}
    with source(["503", "502"], files) as src:
        assert Manifest.load(src.url, Recorded(deadline=60, **QUICK)).splits["train"].num_samples == 4
        assert src.requests == ["/manifest.json"] * 3
    started, ended = wait_lines(caplog)
    assert len(started) == len(ended) == 1
    with source(started=False) as src:
        with pytest.raises(SourceUnavailable, match=rf"{src.url}/manifest.json: no answer for \d+ s, past "
                                                    r"the source deadline of 0.3 s .*; last: URLError: "
                                                    r".*Connection refused"):
            Manifest.load(src.url, Recorded(deadline=0.3, **QUICK))
