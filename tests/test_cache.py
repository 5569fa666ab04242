"""The streaming client against servers that answer ranges wrongly and across forks (a loader's
workers), and the node-local cache with real processes: one
download per shard, killed and damaged downloads never visible, the LRU byte budget, pins."""
from __future__ import annotations

import contextlib
import gc
import hashlib
import http.server
import multiprocessing
import os
import re
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import fsspec
import pytest

from shards.base.errors import DataFault
from shards.io.http_range import HTTPRange, RangeError, Retry, ShardChanged, integrity_problem, range_problem
from shards.read.cache import ENV_BUDGET, CacheFull, Piece, ShardCache
from shards.read.reading import open_range

FAST = Retry(attempts=3, backoff=0.01, deadline=1.0)
SIZE = 300_000
BLOB = bytes(range(256)) * (SIZE // 256) + bytes(SIZE % 256)
SHA = hashlib.sha256(BLOB).hexdigest()
BLOBS = {f"/s{i}.tar": bytes([i]) * SIZE for i in range(4)}
BLOBS["/blob.tar"] = BLOB


class Misbehaving(http.server.BaseHTTPRequestHandler):
    """Serves BLOBS with ranges; ``server.mode`` decides how it answers wrongly."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        srv = self.server
        srv.counts[self.path] += 1
        srv.ranges.append(self.headers.get("Range"))
        srv.ports.append(self.client_address[1])  # which connection asked
        srv.auth.append(self.headers.get("Authorization"))
        srv.cookies.append(self.headers.get("Cookie"))
        first = srv.counts[self.path] == 1
        mode = srv.mode
        if mode == "slow":
            time.sleep(0.3)
        if self.path in srv.held:  # answered once the test lets go
            srv.release.wait(60)
        if mode == "flaky" and first:
            return self._reply(503, {"Content-Length": "0"}, b"")
        if mode == "busy" and first:
            return self._reply(503, {"Content-Length": "0", "Retry-After": str(srv.retry_after)}, b"")
        if mode == "redirect" and not self.path.startswith("/moved"):  # to srv.target's host, or this one
            return self._reply(307, {"Content-Length": "0", "Location": f"{srv.target}/moved{self.path}"},
                               b"")
        data = BLOBS[self.path.removeprefix("/moved")]
        a, b = re.match(r"bytes=(\d+)-(\d+)", self.headers["Range"]).groups()
        a, b = int(a), int(b)
        body = data[a:b + 1]
        headers = {"Content-Range": f"bytes {a}-{b}/{len(data)}", "Content-Length": str(len(body)),
                   "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        if mode == "full":
            return self._reply(200, {"Content-Length": str(len(data))}, data)
        if mode == "total":
            headers["Content-Range"] = f"bytes {a}-{b}/{len(data) + 1}"
        if mode == "etag":
            headers["ETag"] = f'"{"0" * 64}"'
        if mode == "corrupt":
            body = bytes([body[0] ^ 1]) + body[1:]
        if mode == "short" or (mode == "short-first" and first):
            self._reply(206, headers, body[: len(body) // 2], close=True)
            if mode == "short-first":
                time.sleep(0.3)  # let the client take the first half before the connection drops
            return None
        if mode == "hang-up":  # a whole answer, then the connection is closed without saying so beforehand
            return self._reply(206, headers, body, close=True)
        if mode == "stall-first" and first:
            self._reply(206, headers, body[: len(body) // 2])
            srv.release.wait(60)
            self.close_connection = True
            return None
        if mode == "trickle":  # srv.piece bytes at a time, srv.pause seconds apart
            self._reply(206, headers, b"")
            for i in range(0, len(body), srv.piece):
                time.sleep(srv.pause)
                self.wfile.write(body[i:i + srv.piece])
                self.wfile.flush()
            return None
        return self._reply(206, headers, body)

    def _reply(self, status, headers, body, close=False):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        if close:
            self.close_connection = True

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def misbehaving(mode="ok", host="127.0.0.1"):
    srv = http.server.ThreadingHTTPServer((host, 0), Misbehaving)
    srv.daemon_threads = True
    srv.mode, srv.counts, srv.ranges, srv.release, srv.ports = mode, Counter(), [], threading.Event(), []
    srv.auth, srv.cookies = [], []
    srv.held = set()
    srv.retry_after, srv.target, srv.piece, srv.pause = 7, "", SIZE, 0.0
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv, f"http://{host}:{srv.server_address[1]}"
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()


class Waits(Retry):
    """A retry policy that records the waits asked of it instead of sleeping."""

    def __init__(self):
        super().__init__(attempts=3, backoff=0.01, deadline=60.0)
        object.__setattr__(self, "waits", [])

    def wait(self, seconds):
        self.waits.append(seconds)


def test_retry_after_is_honoured():
    with misbehaving("busy") as (srv, url):
        waits = Waits()
        assert open_range(f"{url}/blob.tar", 7, 90_007, size=SIZE, sha256=SHA,
                          retry=waits).read() == BLOB[7:90_007]
    assert waits.waits == [7] and srv.counts["/blob.tar"] == 2  # the server's 7 s, not the 0.01 s backoff


def test_redirects_are_followed_with_the_range_and_checked():
    with misbehaving("redirect") as (srv, url):
        assert open_range(f"{url}/blob.tar", 7, 90_007, size=SIZE, sha256=SHA,
                          retry=FAST).read() == BLOB[7:90_007]
        assert srv.ranges == ["bytes=7-90006", "bytes=7-90006"] and srv.counts["/moved/blob.tar"] == 1
        # the target's answer is checked too
        with pytest.raises(RangeError, match="differs from the manifest"):
            open_range(f"{url}/blob.tar", 0, 99, size=SIZE, sha256="0" * 64, retry=FAST).read()


def test_credentials_follow_a_redirect_to_the_same_host_and_never_to_another(monkeypatch):
    """fsspec's configured headers (as ``FSSPEC_HTTP_HEADERS`` sets them) go to the URL's server
    and, redirected there, to the same server again; a redirect to another host (as the service's
    307 to an object store) gets the range without the ``Authorization`` and ``Cookie`` headers."""
    monkeypatch.setitem(fsspec.config.conf, "http", {"headers": {"Authorization": "Bearer s3cret",
                                                                 "Cookie": "k=v"}})
    with misbehaving("redirect") as (origin, url), misbehaving(host="127.0.0.2") as (other, elsewhere):
        assert open_range(f"{url}/blob.tar", 7, 90_007, size=SIZE, sha256=SHA,
                          retry=FAST).read() == BLOB[7:90_007]
        # asked, then redirected
        assert origin.auth == ["Bearer s3cret"] * 2 and origin.cookies == ["k=v"] * 2
        origin.target = elsewhere
        assert open_range(f"{url}/blob.tar", 7, 90_007, size=SIZE, sha256=SHA,
                          retry=FAST).read() == BLOB[7:90_007]
        # the redirect's request
        assert origin.auth[2:] == ["Bearer s3cret"] and origin.cookies[2:] == ["k=v"]
        assert other.ranges == ["bytes=7-90006"] and other.auth == [None] and other.cookies == [None]


# --- the range check, as a table ------------------------------------------------------------
GOOD = {"Content-Range": "bytes 10-19/100", "Content-Length": "10", "ETag": f'"{SHA}"'}


@pytest.mark.parametrize("status, change, problem", [
    (206, {}, None),
    # an ETag of another kind is not ours to judge
    (206, {"ETag": '"d41d8cd98f00b204e9800998ecf8427e"'}, None),
    (206, {"Content-Length": None}, None),
    (200, {}, "status 200"),
    (206, {"Content-Range": None}, "is not 'bytes 10-19/SIZE'"),
    (206, {"Content-Range": "bytes 10-29/100"}, "other bytes"),
    (206, {"Content-Range": "bytes 0-9/100"}, "other bytes"),
    (206, {"Content-Range": "bytes 10-19/101"}, "total size 101"),
    (206, {"Content-Range": "bytes 10-19/*"}, "total size *"),
    (206, {"Content-Length": "11"}, "Content-Length 11"),
])
def test_range_problem_table(status, change, problem):
    headers = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    found = range_problem(status, headers, 10, 20, size=100)
    assert (found is None) if problem is None else (problem in found)


@pytest.mark.parametrize("status, etag, changed", [
    (206, SHA, False), (200, SHA, False),
    (206, "0" * 64, True), (200, "0" * 64, True),  # another file's SHA-256, for a range or the whole file
    # an ETag of another kind (an object store's) is not ours to judge
    (206, "d41d8cd98f00b204e9800998ecf8427e", False),
    (503, "0" * 64, False),  # no answer of the file: retried as any 5xx
])
def test_integrity_problem_table(status, etag, changed):
    assert (integrity_problem(status, {"ETag": f'"{etag}"'}, SHA) is not None) == changed


@pytest.mark.parametrize("mode", ["full", "total"])
def test_client_rejects_a_server_answering_ranges_wrongly(mode):
    with misbehaving(mode) as (srv, url):
        with pytest.raises(RangeError) as err:
            open_range(f"{url}/blob.tar", 1000, 5000, size=SIZE, sha256=SHA, retry=FAST).read()
        assert (f"{url}/blob.tar: bytes 1000-4999, at byte" in str(err.value)
                and "after 3 attempts" in str(err.value))
        assert srv.counts["/blob.tar"] == 3


def test_another_files_etag_is_an_integrity_failure_at_once_never_retried():
    """Before: the same wrong ETag asked for 5 times (about 4 s), then a RangeError: a deterministic answer
    retried as if it were transient."""
    with misbehaving("etag") as (srv, url):
        with pytest.raises(ShardChanged) as err:
            open_range(f"{url}/blob.tar", 1000, 5000, size=SIZE, sha256=SHA, retry=FAST).read()
    assert srv.counts["/blob.tar"] == 1  # one request
    assert isinstance(err.value, DataFault) and isinstance(err.value, RangeError)
    assert str(err.value) == (f"{url}/blob.tar: the server's ETag {'0' * 64} differs from the manifest's "
                              f"SHA-256 {SHA}: the file changed or is damaged (shards verify names the "
                              f"samples); not retried")


def test_client_retries_a_failed_answer_and_resumes_a_broken_body():
    with misbehaving("flaky") as (srv, url):
        assert open_range(f"{url}/blob.tar", 7, 250_007, size=SIZE, sha256=SHA,
                          retry=FAST).read() == BLOB[7:250_007]
        assert srv.counts["/blob.tar"] == 2
    with misbehaving("short-first") as (srv, url):
        assert open_range(f"{url}/blob.tar", 7, 250_007, size=SIZE, sha256=SHA,
                          retry=FAST).read() == BLOB[7:250_007]
        first, second = srv.ranges
        assert first == "bytes=7-250006"
        resumed = int(re.match(r"bytes=(\d+)-250006", second)[1])
        assert 7 < resumed <= 7 + 125_000  # asked only for what was missing
    with misbehaving("hang-up") as (srv, url):  # a kept-alive connection the server has closed since is
        once = Retry(attempts=1)  # replaced, and that is no failed attempt
        assert [open_range(f"{url}/blob.tar", 0, 99, size=SIZE, sha256=SHA, retry=once).read()
                for _ in range(3)] \
            == [BLOB[:99]] * 3
        assert len(set(srv.ports)) == 3


# --- across forks --------------------------------------------------------------------------
def blocked_in(fn) -> float:
    """Seconds the calling thread spent blocked (neither on a CPU nor waiting for one) in ``fn()``:
    unlike its wall time, independent of the machine's load."""
    def ran_and_queued():
        on_cpu, queued, _ = map(int, open("/proc/thread-self/schedstat").read().split())
        return (on_cpu + queued) / 1e9
    t, busy = time.monotonic(), ran_and_queued()
    fn()
    return (time.monotonic() - t) - (ran_and_queued() - busy)


SHAS = {path: hashlib.sha256(body).hexdigest() for path, body in BLOBS.items()}


def read_blob(url, path):
    return open_range(f"{url}{path}", 0, SIZE, size=SIZE, sha256=SHAS[path]).read()


def _forked_reader(url, half, first, cache, out):
    """A loader worker's reads: go on reading a range the parent opened, collect the parent's
    objects (as a worker's garbage collector will at some point; that cleans up the parent's
    sessions), then read every blob straight, concurrently, and through the parent's cache object."""
    try:
        gc.collect()  # what is garbage already, so that the timing below is of the parent's objects alone
        got = {"continued": first + half.readall() == BLOB}  # drops the parent's filesystem
        got["collect_blocked_s"] = blocked_in(gc.collect)
        with ThreadPoolExecutor(4) as pool:  # concurrent reads, as the loader's stages make
            got["straight"] = [b == BLOBS[p] for p, b in zip(BLOBS,
                                                             pool.map(lambda p: read_blob(url, p), BLOBS))]
        got["cached"] = [open(cache.fetch(f"{url}{p}", SHAS[p], SIZE), "rb").read() == BLOBS[p]
                         for p in BLOBS]
        cache.release()
        out.put(got)
    except Exception as e:  # reported to the test
        out.put(repr(e))


def test_forked_readers_never_use_the_parent_connections(tmp_path):
    """Connections the parent opened (whole ranges read, one left half read) stay the parent's:
    three forked children read concurrently with the parent and each other, every byte right, and
    afterwards the parent's own pooled (keep-alive) connections still answer it."""
    waiter = ThreadPoolExecutor(1)
    within = lambda fn, seconds=60: waiter.submit(fn).result(timeout=seconds)  # noqa: E731  a hang fails
    read_all = lambda times=1: all(read_blob(url, p) == BLOBS[p] for _ in range(times)
                                   for p in BLOBS)  # noqa: E731
    with misbehaving() as (srv, url):
        try:
            half = HTTPRange(f"{url}/blob.tar", 0, SIZE, SIZE, SHA)
            first = half.read(1000)  # unbuffered: the rest of the answer is still the connection's
            assert within(read_all)  # on another connection, kept alive in the pool at the fork
            parents, asked = set(srv.ports), len(srv.ports)  # the parent's connections: pooled, and half's
            cache = ShardCache(str(tmp_path / "cache"), retry=FAST)
            ctx = multiprocessing.get_context("fork")
            results = ctx.Queue()
            children = [ctx.Process(target=_forked_reader, args=(url, half, first, cache, results))
                        for _ in range(3)]
            for c in children:
                c.start()
            assert within(lambda: read_all(2))  # while the children read
            reports = [results.get(timeout=120) for _ in children]
            for c in children:
                c.join(timeout=60)
            for r in reports:
                assert isinstance(r, dict), r
                assert r["continued"] and all(r["straight"]) and all(r["cached"]), r
                # no wait on the parent's event loop, which has no thread here
                assert r["collect_blocked_s"] < 0.5, r
            assert [c.exitcode for c in children] == [0, 0, 0]
            # the parent's reads went over its kept-alive connections, and not one child request did
            assert sum(port in parents for port in srv.ports[asked:]) == 2 * len(BLOBS)
            # the parent's pooled connections, after the children cleaned up theirs
            assert within(read_all, 30)
            assert first + half.readall() == BLOB  # and the range it left half read
        finally:
            waiter.shutdown(wait=False)


def read_through_fsspec(url) -> bytes:
    """A range through fsspec's HTTP filesystem, looked up as ``fsspec.open`` does (manifests, s3fs
    share its event loop): in a forked child the lookup drops the parent's instance."""
    return fsspec.filesystem("http").cat_file(f"{url}/blob.tar", start=0, end=1000)


def _fsspec_child(url, out):
    """A loader worker: reads through fsspec, then collects what it dropped (the parent's filesystem)."""
    got = {}

    def work():
        got["read"] = read_through_fsspec(url) == BLOB[:1000]
        gc.collect()
    try:
        got["blocked_s"] = blocked_in(work)
        out.put(got)
    except Exception as e:  # reported to the test
        out.put(repr(e))


def test_a_forked_child_leaves_the_parents_fsspec_connections_working():
    """The parent reads through fsspec (a kept-alive connection on fsspec's loop); a forked child
    reads through fsspec and collects the parent's filesystem; the parent's next read on its
    connection must answer (without the fork hook the child's clean-up unregistered the parent's
    socket from the shared epoll and that read hung for good), and the child's clean-up must not
    wait for the parent's loop, whose thread did not survive the fork."""
    def within(fn, seconds=10):  # a daemon thread: a hung read fails the test without hanging pytest
        done = []
        threading.Thread(target=lambda: done.append(fn()), daemon=True).start()
        deadline = time.monotonic() + seconds
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        return done[0] if done else f"no answer within {seconds} s"

    read_right = lambda: read_through_fsspec(url) == BLOB[:1000]  # noqa: E731
    with misbehaving() as (srv, url):
        assert within(read_right) is True
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        child = ctx.Process(target=_fsspec_child, args=(url, results))
        child.start()
        got = results.get(timeout=60)
        child.join(timeout=60)
        assert child.exitcode == 0 and isinstance(got, dict) and got["read"], got
        assert within(read_right) is True
        assert len(set(srv.ports)) == 2  # the parent's second read went over its kept-alive connection
        assert got["blocked_s"] < 0.5, got


# --- the cache ------------------------------------------------------------------------------
def _fetch(directory, url, sha, size, out, **lease):
    try:
        out.put(ShardCache(directory, retry=FAST, **lease).fetch(url, sha, size))
    except Exception as e:  # reported to the test
        out.put(repr(e))


def leftovers(directory):
    return sorted(f for _, _, fs in os.walk(directory) for f in fs if not f.endswith(".tar"))


def test_processes_wanting_one_shard_download_it_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    with misbehaving("slow") as (srv, url):
        procs = [ctx.Process(target=_fetch, args=(str(tmp_path), f"{url}/blob.tar", SHA, SIZE, results))
                 for _ in range(4)]
        for p in procs:
            p.start()
        paths = {results.get(timeout=60) for _ in procs}
        for p in procs:
            p.join()
        assert srv.counts["/blob.tar"] == 1
    assert paths == {ShardCache(str(tmp_path)).path(SHA)}
    assert open(paths.pop(), "rb").read() == BLOB and leftovers(tmp_path) == []


def test_a_killed_download_is_never_visible_and_a_waiter_takes_over(tmp_path):
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    final = ShardCache(str(tmp_path)).path(SHA)
    with misbehaving("stall-first") as (srv, url):
        first = ctx.Process(target=_fetch, args=(str(tmp_path), f"{url}/blob.tar", SHA, SIZE, results))
        first.start()
        deadline = time.monotonic() + 30
        while srv.counts["/blob.tar"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        waiter = ctx.Process(target=_fetch, args=(str(tmp_path), f"{url}/blob.tar", SHA, SIZE, results))
        waiter.start()
        time.sleep(0.5)
        assert not os.path.exists(final) and srv.counts["/blob.tar"] == 1  # the waiter waits
        assert any(".tmp-" in f for f in leftovers(tmp_path))
        os.kill(first.pid, signal.SIGKILL)
        first.join()
        assert results.get(timeout=60) == final
        waiter.join()
        assert srv.counts["/blob.tar"] == 2
    assert open(final, "rb").read() == BLOB and leftovers(tmp_path) == []


def test_a_damaged_download_is_never_visible(tmp_path):
    """A copy whose SHA-256 is not the manifest's is an integrity failure (one line, a DataFault;
    before: a bare OSError, a traceback in the trainer), not kept and not downloaded again."""
    cache = ShardCache(str(tmp_path), retry=FAST)
    with misbehaving("corrupt") as (srv, url):
        with pytest.raises(ShardChanged, match=f"^{url}/blob.tar: the copy downloaded has SHA-256 "
                                               f"[0-9a-f]{{64}}, the manifest says {SHA}: the file changed "
                                               f"or is damaged"):
            cache.fetch(f"{url}/blob.tar", SHA, SIZE)
        assert srv.counts["/blob.tar"] == 1
    assert not os.path.exists(cache.path(SHA)) and leftovers(tmp_path) == []


def test_a_damaged_download_whose_reader_checks_each_sample_is_kept_aside_once_a_node(tmp_path):
    """For a reader that checks every sample against the manifest's digests (``Piece.checked``, the
    trainer's loader: its good samples used, its bad ones counted under --max-bad-samples) the
    damaged copy is kept aside under a name of its own, never the shard's, and every other process
    of the node is handed the same copy; a reader that cannot check samples still gets ShardChanged
    (before: ShardChanged for every reader, the run stopped whatever its budget)."""
    # two processes
    first, other = ShardCache(str(tmp_path), retry=FAST), ShardCache(str(tmp_path), retry=FAST)
    with misbehaving("corrupt") as (srv, url):
        piece = Piece(f"{url}/blob.tar", SHA, SIZE, checked=True)
        path = first.get(piece)
        assert path == os.path.join(str(tmp_path), SHA[:2], f"{SHA}.damaged.tar")
        assert not os.path.exists(first.path(SHA))
        assert other.get(piece) == path and other.get(piece) == path and srv.counts["/blob.tar"] == 1
        with pytest.raises(ShardChanged, match=r"the file changed or is damaged \(shards verify names the "
                                               r"samples\); not kept$"):
            other.fetch(f"{url}/blob.tar", SHA, SIZE)
        assert srv.counts["/blob.tar"] == 2
    with open(path, "rb") as f:
        assert f.read() == bytes([BLOB[0] ^ 1]) + BLOB[1:]  # the bytes as they came
    first.release()
    other.release(piece)
    other.release(piece)
    assert leftovers(tmp_path) == []


def test_budget_evicts_the_least_recently_used_shard_not_in_use(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_BUDGET, f"{(2 * SIZE + 10) / 1000}kB")  # as trainers set it
    cache = ShardCache(str(tmp_path), retry=FAST)
    with misbehaving() as (srv, url):
        fetch = lambda p: cache.fetch(f"{url}{p}", SHAS[p], SIZE)  # noqa: E731
        s0, s1 = fetch("/s0.tar"), fetch("/s1.tar")  # s0 is the least recently used, but pinned
        cache.release(SHAS["/s1.tar"])
        s2 = fetch("/s2.tar")
        assert os.path.exists(s0) and not os.path.exists(s1) and os.path.exists(s2)
        with pytest.raises(CacheFull,
                           match="this process pins 600,000 of the 600,010-byte budget; no room for 300,000"):
            fetch("/s3.tar")  # s0 and s2 are both pinned, by this process
        cache.release()
        assert cache.fetch(f"{url}/s3.tar", SHAS["/s3.tar"], SIZE)
        assert sum(os.path.exists(p) for p in (s0, s2)) == 1
    with pytest.raises(CacheFull,
                       match="budget of 600,010 bytes cannot hold three shards \\(900,000 bytes\\)"):
        cache.reserve(3 * SIZE, "three shards")


def wait_for(condition, what, seconds=60):
    """Hold the test until ``condition()`` (a hang fails it, naming what never happened)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def _stream(directory, url, paths, budget, out):
    """A rank's reader: every shard of ``paths`` through the cache, checked byte for byte."""
    try:
        cache = ShardCache(directory, budget, retry=FAST, poll=0.01)
        got = [open(p, "rb").read() == BLOBS[path]
               for path, p in zip(paths, cache.stream([Piece(f"{url}{q}", SHAS[q], SIZE) for q in paths], 2))]
        out.put(got)
    except Exception as e:  # reported to the test
        out.put(repr(e))


def test_processes_share_one_budget_and_wait_for_room_another_process_holds(tmp_path):
    """Another job pins the whole budget: a reader streaming three shards through it waits for room
    instead of failing, and finishes once the other job lets go; then two readers stream eight
    shards through three shards of room, every byte right."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    with misbehaving() as (srv, url):
        other = ShardCache(str(tmp_path), 2 * SIZE, retry=FAST)
        for p in ("/s0.tar", "/s1.tar"):
            other.fetch(f"{url}{p}", SHAS[p], SIZE)
        reader = ctx.Process(target=_stream, args=(str(tmp_path), url, ["/s2.tar", "/s3.tar", "/blob.tar"],
                                                   2 * SIZE, results))
        reader.start()
        lock = ShardCache(str(tmp_path)).path(SHAS["/s2.tar"]) + ".lock"
        wait_for(lambda: not reader.is_alive() or os.path.exists(lock), "the reader locks its first download")
        time.sleep(0.5)  # (it would fail within this if it did not wait)
        assert reader.is_alive() and results.empty() and srv.counts["/s2.tar"] == 0  # it waits for room
        other.release()
        assert results.get(timeout=60) == [True] * 3
        reader.join()
        budget = 3 * SIZE
        BLOBS.update({f"/t{i}.tar": bytes([100 + i]) * SIZE for i in range(8)})
        SHAS.update({p: hashlib.sha256(BLOBS[p]).hexdigest() for p in BLOBS})
        try:
            readers = [ctx.Process(target=_stream, args=(str(tmp_path), url,
                                                         [f"/t{i}.tar" for i in range(k, 8, 2)],
                                                         budget, results)) for k in (0, 1)]
            for r in readers:
                r.start()
            assert [results.get(timeout=120) for _ in readers] == [[True] * 4] * 2
            for r in readers:
                r.join()
        finally:
            for i in range(8):
                BLOBS.pop(f"/t{i}.tar"), SHAS.pop(f"/t{i}.tar")
        assert all(srv.counts[f"/t{i}.tar"] == 1 for i in range(8))
    assert leftovers(tmp_path) == []


def test_a_stream_yields_the_first_copy_while_the_next_still_downloads(tmp_path):
    """The server holds the second shard until the reader has the first: the first copy arrives."""
    cache = ShardCache(str(tmp_path), retry=FAST)
    waiter = ThreadPoolExecutor(1)
    with misbehaving() as (srv, url):
        srv.held.add("/s1.tar")
        copies = cache.stream([Piece(f"{url}/s{i}.tar", SHAS[f"/s{i}.tar"], SIZE) for i in range(3)],
                              lookahead=2)
        try:
            first = waiter.submit(next, copies).result(timeout=60)  # a hang (waiting for /s1.tar) fails
            assert open(first, "rb").read() == BLOBS["/s0.tar"]
            wait_for(lambda: srv.counts["/s1.tar"] == 1,
                     "the second download starts before the first is read")
            assert srv.counts["/s2.tar"] == 0  # lookahead 2: the reader's copy and one more
            srv.release.set()
            assert [open(p, "rb").read() for p in copies] == [BLOBS["/s1.tar"], BLOBS["/s2.tar"]]
        finally:
            srv.release.set()
            copies.close()
            waiter.shutdown()
    assert not cache._pins and leftovers(tmp_path) == []


def test_a_piece_of_a_shard_is_its_own_copy(tmp_path):
    cache = ShardCache(str(tmp_path), retry=FAST)
    with misbehaving() as (srv, url):
        piece = cache.fetch(f"{url}/blob.tar", SHA, SIZE, 1000, 5000)
        assert open(piece, "rb").read() == BLOB[1000:5000] and piece != cache.path(SHA)
        assert srv.ranges == ["bytes=1000-4999"]


def test_a_waiter_gives_up_on_a_live_downloader_that_gets_no_byte(tmp_path):
    """The downloader's server stops mid-body (its connection open, far within the client's
    60 s socket timeout): the downloader, alive with its heartbeat thread running, gets no byte,
    so its lease lapses and a waiter fails after ``lease`` seconds instead of waiting for good.
    Once the server goes on (dropping the connection), the downloader resumes and its copy is whole."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    lease = {"heartbeat": 0.05, "lease": 0.5}
    with misbehaving("stall-first") as (srv, url):
        first = ctx.Process(target=_fetch, args=(str(tmp_path), f"{url}/blob.tar", SHA, SIZE, results),
                            kwargs=lease)
        first.start()
        try:
            wait_for(lambda: srv.counts["/blob.tar"] == 1, "the download starts")
            waiter = ctx.Process(target=_fetch, args=(str(tmp_path), f"{url}/blob.tar", SHA, SIZE, results),
                                 kwargs=lease)
            waiter.start()
            gave_up = results.get(timeout=30)  # a waiter that waits for good fails here
            assert re.fullmatch(r"TimeoutError\('.*/blob.tar: the process downloading this shard to .* has "
                                r"not renewed its lease for \d+ s \(lease 0.5 s\): no byte arrived and it "
                                r"was not waiting'\)", gave_up), gave_up
            waiter.join()
            assert first.is_alive()
            srv.release.set()
            assert results.get(timeout=60) == ShardCache(str(tmp_path)).path(SHA)
        finally:
            srv.release.set()
            first.join(timeout=60)
            if first.is_alive():
                first.kill()
        # the downloader's, resumed
        assert srv.ranges == [f"bytes=0-{SIZE - 1}", f"bytes={SIZE // 2}-{SIZE - 1}"]
    assert open(ShardCache(str(tmp_path)).path(SHA), "rb").read() == BLOB


@pytest.mark.parametrize("mode", ["busy", "trickle"])
def test_a_waiter_waits_for_a_downloader_that_waits_on_purpose_or_moves_slowly(tmp_path, mode):
    """No byte for more than two leases, but the downloader waits as the server asked (503,
    ``Retry-After: 5``, leases of 2 s), or gets its 3 MiB slowly (a chunk of 1 MiB every 0.8 s,
    more than a lease in all): the lease is renewed throughout, and the waiter gets the one
    download."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    lease = {"heartbeat": 0.05, "lease": 2.0}  # the lease leaves room for a busy machine's scheduling
    big = bytes(range(256)) * (3 * 2**20 // 256)
    with misbehaving(mode) as (srv, url):
        srv.retry_after, srv.piece, srv.pause = 5, 2**20, 0.8
        BLOBS["/big.tar"] = big
        try:
            sha = hashlib.sha256(big).hexdigest()
            fetch = (str(tmp_path), f"{url}/big.tar", sha, len(big), results)
            first = ctx.Process(target=_fetch, args=fetch, kwargs=lease)
            first.start()
            wait_for(lambda: srv.counts["/big.tar"] == 1, "the download starts")
            waiter = ctx.Process(target=_fetch, args=fetch, kwargs=lease)
            waiter.start()
            assert [results.get(timeout=60) for _ in range(2)] == [ShardCache(str(tmp_path)).path(sha)] * 2
            first.join(), waiter.join()
        finally:
            BLOBS.pop("/big.tar")
        assert srv.counts["/big.tar"] == (2 if mode == "busy" else 1)  # the downloader's alone


def test_a_waiter_gives_up_on_a_downloader_that_stopped_renewing_its_lease(tmp_path):
    """A downloader that is alive but stopped (SIGSTOP: hung) keeps its lock, not its lease."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    lease = {"heartbeat": 0.05, "lease": 0.5}
    with misbehaving("stall-first") as (srv, url):
        first = ctx.Process(target=_fetch, args=(str(tmp_path), f"{url}/blob.tar", SHA, SIZE, results),
                            kwargs=lease)
        first.start()
        wait_for(lambda: srv.counts["/blob.tar"] == 1, "the download starts")
        os.kill(first.pid, signal.SIGSTOP)
        try:
            _fetch(str(tmp_path), f"{url}/blob.tar", SHA, SIZE, results, **lease)
            assert re.fullmatch(r"TimeoutError\('.*/blob.tar: the process downloading this shard to .* has "
                                r"not renewed its lease for \d+ s \(lease 0.5 s\): "
                                r"no byte arrived and it was not waiting'\)", results.get(timeout=60))
        finally:
            os.kill(first.pid, signal.SIGKILL)
            first.join()
