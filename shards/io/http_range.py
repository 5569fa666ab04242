"""Byte ranges over HTTP, checked, resumed where they broke off, and patient with a source that is
down: one GET per range on a kept-alive connection.

Every response must be exactly what was asked (``range_problem``): 206, a ``Content-Range``
whose first and last byte and total size are the requested ones, a ``Content-Length`` equal
to the range, a body of that length, and, when the server sends a SHA-256 strong ETag (as
the dataset service does), the manifest's SHA-256. What a failure calls for is decided in one
place, ``classify``:

* an outage (``OUTAGE``): no answer (the connection refused, reset or cut off mid-body, nothing
  heard for ``Retry.stall`` seconds) or 408, 425, 429, 502, 503, 504. The reader waits for the
  source, asking again from the first missing byte with capped exponential backoff and jitter (or
  as long as a ``Retry-After`` says), for up to ``Retry.deadline`` seconds from the first failure
  (``--source-deadline``, ``$SHARD_SOURCE_DEADLINE``; 10 minutes by default: a service restart, a
  rolling upgrade, a host's reboot), then raises ``shards.base.errors.SourceUnavailable`` (exit status
  75: resume later) naming the URL, how long it waited and the last problem. Any bytes of the
  answer end the wait. One log line when a source first fails (per server and process, however
  many readers wait for it) and one when it answers again, with how long that took.
* a wrong answer (``WRONG``: a 500 or another 5xx, a 200 with the whole file, another
  ``Content-Range`` or ``Content-Length``): asked again ``Retry.attempts`` times in all per range,
  then ``RangeError`` naming the URL, the bytes and the last problem.
* a deterministic failure (``FATAL``): 404 (``FileNotFoundError``) and every other 4xx
  (``RangeError``), and a SHA-256 strong ETag that is not the manifest's SHA-256
  (``integrity_problem``: the server's file is not the one the manifest describes, changed or
  damaged; ``ShardChanged``): raised at once, asking again will not help. Except for a reader
  that checks every sample against the manifest's per-sample digests (``checked``) when the server
  says it serves a damaged set as it is at the client's request (``Preference-Applied:
  handling=lenient``, the dataset service's answer to ``Prefer: handling=lenient``): such a reader
  goes on, and meets the damage sample by sample (``--max-bad-samples``).

``RangeError`` is a ``shards.base.errors.DataFault``: a trainer stops on it with its position saved.
``Patience`` carries the policy for every reader of a source (this client, object-store chunks in
``shards.read.reading``, the manifest read): anything that fetches from a source can wait for it alike.

Redirects (301, 302, 303, 307, 308; at most ``MAX_REDIRECTS`` in a row) are followed with the same ``Range``,
as the service's ``307`` to a presigned object-store URL needs; the answer is checked as any other (an object
store's ETag is not a SHA-256 and is not compared), ``Authorization`` is not sent to another
host, and a retry starts again from the original URL.

Grants (the dataset service behind nginx, ``service.grants``): a redirect that says it may be kept
(``Cache-Control: private, max-age=N``, N > 0, RFC 9111 §4.2) is remembered by this process
(``_GRANTS``) for N seconds, and every later range of that URL, from any thread, goes to its target
at once. A 403 or 410 from a target the reader had kept or had bytes from (nginx: the grant
expired, or its secret changed) sends the reader back to the original URL for a new one, without
counting as a failure; from a target just given, it is the refusal it says.

The hot path is the standard library's blocking HTTP/1.1 client (``http.client``) in the reading
thread: no hop to an event loop, the body received straight into the bytes object the reader
gets (one copy from the kernel), and connections kept alive in a per-process pool, so a range
costs one request on an open connection. A pooled connection the server has since closed is
replaced once without counting as a failure.

Headers from fsspec's configuration go with every request (``FSSPEC_HTTP_HEADERS='{"Authorization":
"Bearer TOKEN"}'`` or ``~/.config/fsspec/http.json``), so a service started with ``--read-auth`` is read
like any other.

Fork safety (loader workers are forked): a connection is never shared by two processes.

* A range opened before a fork and read on in the child asks again, from its first unread byte,
  through the child's own connection; the parent's response is left to the parent.
* The child starts with an empty connection pool (``_POOL``); its copies of the parent's pooled
  sockets are dropped unused (closing a copied descriptor leaves the parent's connection open).
* fsspec gives a forked child new filesystems and a new event loop, but the child still holds
  copies of the parent's, and cleaning those up (when collected, or at exit) closes their pooled
  connections through the copied loop, whose epoll instance and sockets the kernel shares with
  the parent: the parent's sockets are unregistered from its epoll, and its next request on such a
  connection waits for an answer that never wakes it (5 minutes, aiohttp's timeout); and the
  child's cleanup first waits a second for a loop whose thread did not survive the fork. So at the
  fork the child's copies of those descriptors are pointed at /dev/null and the copied loop is
  marked not running (``_after_fork_in_child``). This covers every fsspec filesystem on fsspec's
  shared loop (HTTP in ``fsspec.open``, which reads manifests, and s3fs).

Why one file of about 640 lines: the outage policy (``classify``, ``Retry``, ``Patience``,
``patiently``, the problems of an answer) and the client that obeys it (``HTTPRange``, its
connection pool, the fork hooks guarding that pool) are one contract: every answer the client
reads is judged by the rules the manifest read and the node cache's downloads wait by, and the
messages name both halves' figures. The policy could become a module of its own the day a second
client needs it.
"""
from __future__ import annotations

import email.utils
import http.client
import io
import logging
import os
import random
import re
import threading
import time
import urllib.parse
from asyncio.selector_events import BaseSelectorEventLoop
from dataclasses import dataclass
from typing import Mapping

import fsspec.asyn

from ..base.errors import DataFault, SourceUnavailable, UsageError
from .storage import http_headers

log = logging.getLogger(__name__)

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")
_SHA256_ETAG = re.compile(r'"([0-9a-f]{64})"$')
_REDIRECTS = {301, 302, 303, 307, 308}
MAX_REDIRECTS = 5
ENV_DEADLINE = "SHARD_SOURCE_DEADLINE"
# A service restart takes seconds, a rolling upgrade of a few replicas or a host's reboot a few
# minutes; a source still down after 10 is not coming back soon, and a job is better stopped
# (position saved, exit 75) and requeued than holding every node idle longer.
DEFAULT_DEADLINE = 600.0

OUTAGE, WRONG, FATAL = "outage", "wrong answer", "fatal"
# the answers of a source that is there but cannot answer now: timeouts, too early, too many
# requests, and a gateway whose upstream is down, timed out or restarting
OUTAGE_STATUSES = frozenset({408, 425, 429, 502, 503, 504})


def classify(status: int | None) -> str:
    """What a failed request calls for (the module docstring): ``OUTAGE`` (wait for the source up to
    the deadline), ``WRONG`` (ask again a few times) or ``FATAL`` (raise at once). ``status`` None:
    no answer at all (refused, reset, cut off, timed out). An answer of another file than the
    manifest's is decided before (``integrity_problem``): no status can repair it."""
    if status is None or status in OUTAGE_STATUSES:
        return OUTAGE
    if 400 <= status < 500:
        return FATAL
    return WRONG


def deadline_from_env() -> float:
    """``$SHARD_SOURCE_DEADLINE`` seconds, or ``DEFAULT_DEADLINE``."""
    text = os.environ.get(ENV_DEADLINE, "").strip()
    if not text:
        return DEFAULT_DEADLINE
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise UsageError(f"${ENV_DEADLINE}={text!r}: give the seconds a source may stay unreachable, 0 or "
                         f"more")
    return value


@dataclass(frozen=True)
class Retry:
    """How readers treat a failing source (see the module docstring)."""
    # seconds a source may stay unreachable; None: $SHARD_SOURCE_DEADLINE, or 600
    deadline: float | None = None
    attempts: int = 5  # tries per range when the answers are wrong (not an outage) before giving up
    backoff: float = 0.25  # seconds before the second try, doubling up to max_backoff
    max_backoff: float = 5.0
    max_retry_after: float = 120.0  # the longest wait a server's Retry-After gets
    stall: float = 60.0  # seconds without a byte on a connection: the source is taken to be down

    @property
    def patience(self) -> float:
        return deadline_from_env() if self.deadline is None else self.deadline

    def backoff_for(self, failures: int) -> float:
        """The pause after the ``failures``-th failure in a row: exponential, capped, with jitter
        (half to all of it, so that many readers do not come back at the same instant)."""
        base = min(self.max_backoff, self.backoff * 2 ** (failures - 1))
        return base * (0.5 + _JITTER.random() / 2)

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (RFC 9110 §10.2.3), None if absent or unreadable."""
    value = (value or "").strip()
    if value.isdigit() and len(value) <= 9:
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


DEFAULT_RETRY = Retry()
# the jitter's own generator: the global one's state is a trainer's to checkpoint, and reseeded in a
# forked child (a loader worker), whose jitter would otherwise repeat its parent's and its siblings'
_JITTER = random.Random()


class RangeError(DataFault, OSError):
    """A byte range that could not be read as asked: a deterministic refusal, or wrong answers
    after ``Retry.attempts`` tries."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _Outages:
    """The servers this process is waiting for, since when: one log line when the first of its
    readers finds one down, one when any of them gets an answer again (not one per retry)."""

    def __init__(self):
        self.since: dict[str, float] = {}
        self.lock = threading.Lock()
        # since the last ``take_waits``: outages readers met, seconds they slept
        self.waits, self.waited = 0, 0.0

    def began(self, server: str, problem: str, deadline: float) -> None:
        with self.lock:
            self.waits += 1
            first = server not in self.since
            if first:
                self.since[server] = time.monotonic()
        if first:
            log.warning("%s is not answering (%s): waiting for it, up to %s (--source-deadline, $%s)", server,
                        problem, _seconds(deadline), ENV_DEADLINE)

    def ended(self, server: str) -> None:
        with self.lock:
            since = self.since.pop(server, None)
        if since is not None:
            log.warning("%s answers again, after %.1f s", server, time.monotonic() - since)

    def slept(self, seconds: float) -> None:
        with self.lock:
            self.waited += seconds

    def forget(self) -> None:
        """In a forked child: the parent's waits are the parent's to report."""
        self.since, self.lock, self.waits, self.waited = {}, threading.Lock(), 0, 0.0


_OUTAGES = _Outages()


def take_waits() -> tuple[int, float]:
    """The outages this process's readers met (each reader's wait for a source that was down counted
    once) and the seconds they slept in them, since the last call: what a loader batch carries to its
    rank for the trainer's figures (``trainer.prometheus``)."""
    with _OUTAGES.lock:
        taken, _OUTAGES.waits, _OUTAGES.waited = (_OUTAGES.waits, _OUTAGES.waited), 0, 0.0
    return taken


def _seconds(value: float) -> str:
    return f"{value:g} s" if value < 120 else f"{value / 60:g} min"


def server_of(url: str) -> str:
    """``scheme://host[:port]`` of a URL, what an outage is reported for."""
    u = urllib.parse.urlsplit(url)
    return f"{u.scheme}://{u.netloc.rpartition('@')[2]}" if u.netloc else url


class Patience:
    """One reader's dealings with its source under a ``Retry`` policy: ``failed`` after each failed
    try (it waits before the next, or raises), ``answered`` when the source delivered again."""

    def __init__(self, url: str, retry: Retry = DEFAULT_RETRY):
        self.url, self.retry, self.server = url, retry, server_of(url)
        self.since: float | None = None  # when the current outage began for this reader
        self.outage_failures = 0  # failed tries in the current outage (the backoff's exponent)
        self.wrong = 0  # wrong answers so far

    def failed(self, kind: str, problem: str, where: str = "", wait: float | None = None) -> None:
        """A try failed (``kind`` from ``classify``): raise, or wait before the next (``wait``
        seconds when the server said, else the backoff). ``where``: what was being read, for the
        message (such as ``bytes 0-99, at byte 50``)."""
        at = f"{self.url}: {where}: " if where else f"{self.url}: "
        if kind == FATAL:
            raise RangeError(at + problem)
        if kind == WRONG:
            self.wrong += 1
            if self.wrong >= self.retry.attempts:
                raise RangeError(f"{at}{problem}; gave up after {self.wrong} attempts")
            self.retry.wait(min(self.retry.backoff_for(self.wrong) if wait is None else wait,
                                self.retry.max_retry_after))
            return
        deadline, now = self.retry.patience, time.monotonic()
        if self.since is None:
            self.since, self.outage_failures = now, 0
            _OUTAGES.began(self.server, problem, deadline)
        waited = now - self.since
        if waited >= deadline:
            raise SourceUnavailable(f"{at}no answer for {waited:.0f} s, past the source deadline of "
                                    f"{_seconds(deadline)} (--source-deadline, ${ENV_DEADLINE}); last: "
                                    f"{problem}")
        self.outage_failures += 1
        pause = min(self.retry.backoff_for(self.outage_failures) if wait is None else wait,
                    self.retry.max_retry_after, deadline - waited)
        _OUTAGES.slept(pause)
        self.retry.wait(pause)

    def answered(self) -> None:
        if self.since is not None:
            self.since = None
            _OUTAGES.ended(self.server)


def patiently(fetch, url: str, retry: Retry = DEFAULT_RETRY):
    """``fetch()``'s result, waiting for its source through outages as a range is read (a read of a
    whole small file, such as a manifest, with the standard library's client, ``storage.read_bytes``:
    its errors are classified by their HTTP status, or as no answer when the connection failed, an
    ``OSError``). Other failures are raised as they came."""
    patience = Patience(url, retry)
    while True:
        try:
            data = fetch()
        except FileNotFoundError:
            raise
        except Exception as e:
            status = getattr(e, "status", None)
            unanswered = isinstance(e, OSError)
            if (classify(status) if isinstance(status, int) else OUTAGE if unanswered else FATAL) != OUTAGE:
                raise
            patience.failed(OUTAGE, f"{type(e).__name__}: {e}")
            continue
        patience.answered()
        return data


class ShardChanged(RangeError):
    """The server says by its ETag that its file is not the one the manifest describes: an
    integrity failure, the same however often asked, so never retried."""


LENIENT = "handling=lenient"  # RFC 7240: the dataset service serves a damaged set's files as they are


def integrity_problem(status: int, headers: Mapping[str, str], sha256: str | None,
                      checked: bool = False) -> str | None:
    """Why a successful answer is not of the file the manifest describes (its SHA-256 strong ETag is
    another file's), or None. Deterministic: every retry would get the same. ``checked``: the reader
    checks every sample, so a damaged file served leniently (module docstring) is no problem here."""
    etag = _SHA256_ETAG.match(headers.get("ETag", "").strip())
    lenient = headers.get("Preference-Applied", "").strip().lower() == LENIENT
    if 200 <= status < 300 and sha256 and etag and etag[1] != sha256 and not (checked and lenient):
        return (f"the server's ETag {etag[1]} differs from the manifest's SHA-256 {sha256}: the file changed "
                "or is damaged (shards verify names the samples); not retried")
    return None


def range_problem(status: int, headers: Mapping[str, str], start: int, end: int,
                  size: int | None = None) -> str | None:
    """Why a response to ``Range: bytes=start-(end-1)`` cannot be used, or None if it can.

    ``size``: the file's total size as the manifest says.
    """
    if status != 206:
        return f"status {status}, expected 206 Partial Content"
    text = headers.get("Content-Range", "")
    m = _CONTENT_RANGE.match(text.strip())
    if not m:
        return f"Content-Range {text!r} is not 'bytes {start}-{end - 1}/SIZE'"
    first, last, total = int(m[1]), int(m[2]), m[3]
    if (first, last) != (start, end - 1):
        return f"Content-Range {text!r} answers other bytes than {start}-{end - 1}"
    if total == "*" or (size is not None and int(total) != size) or int(total) < end:
        expected = size if size is not None else f">= {end}"
        return f"Content-Range {text!r}: total size {total}, expected {expected}"
    length = headers.get("Content-Length")
    if length is not None and length.strip() != str(end - start):
        return f"Content-Length {length}, expected {end - start}"
    return None


class _Pool:
    """Idle kept-alive connections of this process, by (scheme, host, port)."""

    def __init__(self, idle_per_host: int = 64):
        self.idle: dict[tuple, list[http.client.HTTPConnection]] = {}
        self.lock = threading.Lock()
        self.idle_per_host = idle_per_host

    def get(self, key: tuple) -> http.client.HTTPConnection | None:
        with self.lock:
            conns = self.idle.get(key)
            return conns.pop() if conns else None

    def put(self, key: tuple, conn: http.client.HTTPConnection) -> None:
        with self.lock:
            conns = self.idle.setdefault(key, [])
            if len(conns) < self.idle_per_host:
                conns.append(conn)
                return
        conn.close()

    def forget(self) -> None:
        """In a forked child: the parent's connections are not ours to use."""
        self.idle, self.lock = {}, threading.Lock()


_POOL = _Pool()


class _Grants:
    """Redirects this process may keep (module docstring): URL -> (target, monotonic expiry)."""

    def __init__(self):
        self.kept: dict[str, tuple[str, float]] = {}
        self.lock = threading.Lock()

    def get(self, url: str) -> str | None:
        with self.lock:
            target, until = self.kept.get(url, (None, 0.0))
        return target if time.monotonic() < until else None

    def keep(self, url: str, target: str, cache_control: str) -> None:
        directives = {d.strip().lower() for d in cache_control.split(",")}
        ages = [int(d[8:]) for d in directives if d.startswith("max-age=") and d[8:].isdigit()
                and len(d) < 18]
        if ages and ages[0] > 0 and not directives & {"no-store", "no-cache"}:
            with self.lock:
                self.kept[url] = (target, time.monotonic() + ages[0])

    def drop(self, url: str, target: str) -> None:
        with self.lock:
            if self.kept.get(url, (None,))[0] == target:
                del self.kept[url]


_GRANTS = _Grants()
_RENEW = {403, 410}  # a kept grant's target refusing it: ask the original URL again


class HTTPRange(io.RawIOBase):
    """Bytes [start, end) of an HTTP(S) URL as a raw stream (wrap it in ``io.BufferedReader``)."""

    def __init__(self, url: str, start: int, end: int, size: int | None = None, sha256: str | None = None,
                 retry: Retry = DEFAULT_RETRY, checked: bool = False):
        self.url, self.start, self.pos, self.end = url, start, start, end
        self.size, self.sha256, self.retry, self.checked = size, sha256, retry, checked
        self._go(url)
        self.origin, self.hops = self.key, 0
        kept = _GRANTS.get(url)  # the target of a grant this process holds, if any (module docstring)
        if kept:
            self._go(kept)
        self.renewable = bool(kept)  # a 403 or 410 from the target asks for a new grant
        self.pid = os.getpid()
        self.conn, self.r = None, None  # the connection and its open response
        self.patience = Patience(url, retry)
        self.answer_from = start  # where the current answer's body began

    def _go(self, url: str) -> None:
        """Send the next request to ``url`` (the original one, or where a redirect pointed)."""
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"{url}: not an http(s) URL")
        self.where = url
        self.key = (u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80))
        self.target = urllib.parse.quote(u.path or "/",
                                         safe="/%~@:+!$&'()*,;=") + (f"?{u.query}" if u.query else "")

    def readable(self) -> bool:
        return True

    def _failed(self, kind: str, problem: str, wait: float | None = None) -> None:
        """Note a failure of ``kind`` (``classify``'s); raise, or wait (``wait`` seconds, or the
        backoff) before the next try, which starts again from the original URL."""
        self._drop()
        self.patience.failed(kind, problem, f"bytes {self.start}-{self.end - 1}, at byte {self.pos}", wait)
        if self.where != self.url:
            self._go(self.url)
            self.hops = 0

    def _cut(self, kind: str, problem: str) -> None:
        """The answer broke off. If it had delivered bytes, the source was there: ask at once for
        the rest (no wait, no failure counted); if not, it failed."""
        if self.pos > self.answer_from:
            self._drop()
        else:
            self._failed(kind, problem)

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """A connection to the URL's server, and whether it was pooled (so may have been closed by now)."""
        conn = _POOL.get(self.key)
        if conn is not None:
            return conn, True
        scheme, host, port = self.key
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        return cls(host, port, timeout=self.retry.stall), False

    def _request(self) -> None:
        """Send the GET for the missing bytes and receive the answer's headers."""
        headers = {**http_headers(self.key[0]), "Range": f"bytes={self.pos}-{self.end - 1}"}
        if self.key != self.origin:  # redirected to another server: credentials stay with ours
            headers = {k: v for k, v in headers.items() if k.lower() not in ("authorization", "cookie")}
        while True:
            conn, pooled = self._connection()
            conn.timeout = self.retry.stall
            if conn.sock is not None:  # (a pooled connection another reader's policy made)
                conn.sock.settimeout(self.retry.stall)
            try:
                conn.request("GET", self.target, headers=headers)
                self.conn, self.r = conn, conn.getresponse()
                self.answer_from = self.pos
                return
            except (ConnectionError, http.client.BadStatusLine):
                conn.close()
                if not pooled:
                    raise  # a stale pooled connection is replaced; a fresh one failing is a failure
            except BaseException:
                conn.close()
                raise

    def _open(self) -> None:
        try:
            self._request()
        except (http.client.HTTPException, OSError) as e:
            return self._failed(_kind_of(e), f"{type(e).__name__}: {e}")
        r = self.r
        if r.status != 206:
            self._drop()  # whatever its body, this connection is not reused
        if r.status in _REDIRECTS and r.headers.get("Location"):
            if self.hops >= MAX_REDIRECTS:
                raise RangeError(f"{self.url}: more than {MAX_REDIRECTS} redirects in a row (last to "
                                 f"{self.where})")
            self.hops += 1
            target = urllib.parse.urljoin(self.where, r.headers["Location"])
            if self.where == self.url:
                _GRANTS.keep(self.url, target, r.headers.get("Cache-Control", ""))
            self.renewable = False
            return self._go(target)
        if r.status in _RENEW and self.renewable and self.where != self.url:
            _GRANTS.drop(self.url, self.where)  # expired or revoked: a new grant from the original URL
            self.renewable = False
            return self._go(self.url)
        if r.status == 404:
            raise FileNotFoundError(f"{self.url}: not found (404)")
        changed = integrity_problem(r.status, r.headers, self.sha256, self.checked)
        if changed:
            self._drop()
            raise ShardChanged(f"{self.url}: {changed}")
        problem = range_problem(r.status, r.headers, self.pos, self.end, self.size)
        if problem:
            wait = retry_after(r.headers.get("Retry-After")) if r.status in (429, 503) else None
            return self._failed(classify(r.status), problem if wait is None else f"{problem} (Retry-After: "
                                f"{wait:g} s)", wait)

    def _forked(self) -> bool:
        """After a fork, in the child: forget the parent's response and connection (the child asks
        again, from ``pos``, on its own connection). True if that happened."""
        if self.pid == os.getpid():
            return False
        self.pid, self.conn, self.r = os.getpid(), None, None
        return True

    def _body(self, read, want: int):
        """The next 1 to ``want`` bytes of the range through ``read(r, want)`` (nothing at its end),
        opening or reopening as needed."""
        self._forked()
        want = min(want, self.end - self.pos)
        while want > 0:
            if self.r is None:
                self._open()
                continue
            try:
                got = read(self.r, want)
            except (http.client.HTTPException, OSError) as e:
                self._cut(_kind_of(e), f"reading the body: {type(e).__name__}: {e}")
                continue
            if not got:
                self._cut(OUTAGE, f"the body ended {self.end - self.pos} bytes short (connection closed)")
                continue
            self.patience.answered()
            self.renewable = self.where != self.url  # a target that delivered may be renewed when it refuses
            self.pos += got if isinstance(got, int) else len(got)
            if self.pos == self.end:
                self._release()
            return got
        return None

    def readinto(self, buf) -> int:
        return self._body(lambda r, n: r.readinto(memoryview(buf)[:n]), len(buf)) or 0

    def readall(self) -> bytes:
        parts = []
        while chunk := self._body(http.client.HTTPResponse.read, self.end - self.pos):
            parts.append(chunk)
        return b"".join(parts)

    def _release(self) -> None:
        """The whole answer read: its connection goes back to the pool."""
        conn, r = self.conn, self.r
        self.conn, self.r = None, None
        if r.will_close or r.read(1):  # the server closes it, or a chunked body has more than the range
            conn.close()
        else:
            _POOL.put(self.key, conn)

    def _drop(self) -> None:
        if not self._forked() and self.conn is not None:
            self.conn.close()  # mid-body: the connection cannot be reused
        self.conn, self.r = None, None

    def close(self) -> None:
        self._drop()
        super().close()


def _kind_of(error: Exception) -> str:
    """A request that raised: no answer (refused, reset, timed out, cut off) is an outage; an
    answer that is not HTTP is a wrong one."""
    return OUTAGE if isinstance(error, (OSError, http.client.IncompleteRead)) else WRONG


# --- fork safety: the child's copy of fsspec's event loop -----------------------------------------
_loop_at_fork: list = []


def _before_fork() -> None:
    _loop_at_fork[:] = [fsspec.asyn.loop[0]]  # fsspec forgets it in the child before our hook runs


def _after_fork_in_child() -> None:
    """Forget this module's pooled connections and waits, which are the parent's, and draw other
    jitter. Cut the parent's loop, as copied into this child, off from everything the parent uses: each
    socket it holds open (connections, its wake-up socket pair) is pointed at /dev/null, so whatever
    the child's copies do later (unregister from epoll, write, close) reaches none of the parent's
    connections; and the loop is marked not running (its thread stayed in the parent), so fsspec
    closes inherited sessions without waiting a second for it."""
    _POOL.forget()
    _OUTAGES.forget()
    _JITTER.seed()
    loop = _loop_at_fork.pop() if _loop_at_fork else None
    if not isinstance(loop, BaseSelectorEventLoop) or loop.is_closed():
        return
    loop._thread_id = None
    # open sockets only: a closed transport's number may have been reused by another file since
    sockets = [t.get_extra_info("socket") for t in list(loop._transports.values())]
    fds = {s.fileno() for s in sockets if s is not None} | {loop._ssock.fileno(), loop._csock.fileno()}
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in fds - {-1}:
        os.dup2(null, fd, inheritable=False)
    os.close(null)


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child,
                    after_in_parent=_loop_at_fork.clear)
