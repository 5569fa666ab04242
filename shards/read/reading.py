"""Byte-range reads of shards, local or over fsspec, and a node-local shard cache.

Readers learn sizes and offsets from the manifest, so a read is one open of one byte range:
no stat, no directory listing. Local files are read with ``pread`` on a plain descriptor
(Python's ``open`` would add an ``fstat``); a descriptor can be opened once and shared by
forked loader workers. HTTP ranges are one streamed GET with a ``Range`` header, every
response checked and retried (``shards.io.http_range``). Other fsspec filesystems (s3, gcs,
memory) are read with one ranged ``cat_file`` per chunk: object stores get no metadata
request (a HEAD) per range, since the manifest already gave the size. ``open_samples`` checks
each sample of a range against the manifest's digest on the way (``shards.format.digests``), whatever
stream the bytes came through. ``read_ahead`` reads a list of remote ranges a bounded number of
bytes ahead of their reader, in a thread. The node-local shard cache is ``shards.read.cache``.
"""
from __future__ import annotations

import bisect
import io
import os
import queue
import threading
from typing import BinaryIO, Iterator

from fsspec.core import url_to_fs

from ..base.errors import DataFault
from ..format.digests import CheckedSamples, CorruptSample, ShortShard, read_upto
from ..format.sample import BadSample, Sample, parse
from ..io.http_range import DEFAULT_RETRY, OUTAGE, WRONG, HTTPRange, Patience, RangeError, Retry
from ..io.storage import local_path, open_fd

READ_BUFFER = 1 << 20  # bytes per read call on local files; tar parsing asks for 10 KiB at a time
OBJECT_CHUNK = 16 << 20  # bytes per request to an object store


class _PreadFile(io.RawIOBase):
    """Bytes [start, end) of a file descriptor, read with pread (the fd's offset is never used,
    so processes sharing the descriptor do not disturb each other)."""

    def __init__(self, fd: int, start: int, end: int, owns_fd: bool):
        self.fd, self.pos, self.end, self.owns_fd = fd, start, end, owns_fd

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), self.end - self.pos)
        if n <= 0:
            return 0
        got = os.preadv(self.fd, [memoryview(buf)[:n]], self.pos)
        self.pos += got
        return got

    def readall(self) -> bytes:
        data = os.pread(self.fd, max(0, self.end - self.pos), self.pos)
        self.pos += len(data)
        return data

    def close(self) -> None:
        if self.owns_fd and not self.closed:
            os.close(self.fd)
        super().close()


class _Chunked(io.RawIOBase):
    """Bytes [start, end) of an fsspec file, one ranged ``cat_file`` per chunk, each checked for
    length; a store that fails is waited for, and short answers asked again, as HTTP ranges are
    (``shards.io.http_range.Patience``)."""

    def __init__(self, url: str, start: int, end: int, retry: Retry):
        self.url, self.pos, self.end, self.retry = url, start, end, retry
        self.fs, self.path = url_to_fs(url)
        self.buf, self.at = b"", 0

    def readable(self) -> bool:
        return True

    def _fetch(self) -> None:
        patience = Patience(self.url, self.retry)
        want = min(OBJECT_CHUNK, self.end - self.pos)
        while True:
            try:
                data = self.fs.cat_file(self.path, start=self.pos, end=self.pos + want)
            except FileNotFoundError:
                raise FileNotFoundError(f"{self.url}: not found") from None
            except PermissionError as e:
                raise RangeError(f"{self.url}: {e}") from None
            except OSError as e:  # the store's client gave up on a connection or an answer: wait for it
                patience.failed(OUTAGE, f"{type(e).__name__}: {e}", f"bytes {self.pos}-{self.pos + want - 1}")
                continue
            patience.answered()
            if len(data) == want:
                self.buf, self.at = data, 0
                return
            patience.failed(WRONG, f"{len(data)} bytes, expected {want}",
                            f"bytes {self.pos}-{self.pos + want - 1}")

    def readinto(self, buf) -> int:
        if self.pos >= self.end:
            return 0
        if self.at >= len(self.buf):
            self._fetch()
        n = min(len(buf), len(self.buf) - self.at)
        buf[:n] = self.buf[self.at:self.at + n]
        self.at += n
        self.pos += n
        return n


def open_range(url: str, start: int, end: int, fd: int | None = None, *, size: int | None = None,
               sha256: str | None = None, retry: Retry = DEFAULT_RETRY, checked: bool = False) -> BinaryIO:
    """A readable stream of exactly bytes [start, end) of ``url``.

    ``fd``: an already open descriptor of the same local file, used instead of opening it.
    ``size``, ``sha256``: the file's size and digest from the manifest, which HTTP answers
    must agree with (``checked``: the caller checks every sample of these bytes against its digest,
    so a damaged set served as it is on request is read on: ``shards.io.http_range``).
    """
    path = local_path(url)
    if fd is not None or path is not None:
        owns = fd is None
        if owns:
            fd = open_fd(path)
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
        return io.BufferedReader(_PreadFile(fd, start, end, owns), READ_BUFFER)
    if url.startswith(("http://", "https://")):
        return io.BufferedReader(HTTPRange(url, start, end, size, sha256, retry, checked), READ_BUFFER)
    return io.BufferedReader(_Chunked(url, start, end, retry), READ_BUFFER)


def open_samples(url: str, shard, start: int, end: int, fd: int | None = None, *,
                 retry: Retry = DEFAULT_RETRY, stream: BinaryIO | None = None, replace=None) -> BinaryIO:
    """``open_range`` of bytes [start, end) of a shard (a manifest ``ShardInfo``) that begin and end
    at sample boundaries, every sample checked against the manifest's digest (format /2 manifests;
    older ones have none, and their ranges are read unchecked). ``stream``: those bytes already
    opened elsewhere (a node-cache copy, a read-ahead); a sample that fails its check is still read
    again from ``url``, the source. ``replace``: what a sample that fails twice is read as, instead
    of raising (``CheckedSamples``)."""
    opener = lambda a, b: open_range(url, a, b, fd, size=shard.bytes, sha256=shard.sha256,  # noqa: E731
                                     retry=retry, checked=bool(shard.digests))
    if not shard.digests:
        return stream if stream is not None else opener(start, end)
    first = bisect.bisect_left(shard.offsets, start)
    last = bisect.bisect_left(shard.offsets, end) - 1
    if first > last or shard.offsets[first] != start or shard.offsets[last] + shard.lengths[last] != end:
        raise ValueError(f"{url}: bytes {start}-{end - 1} are not whole samples of {shard.name}")
    return io.BufferedReader(CheckedSamples(url, shard, first, last, opener, stream, replace), READ_BUFFER)


class _Ahead(io.RawIOBase):
    """The reader's side of one range of ``read_ahead``: chunks as the thread (``reader``) queued
    them."""

    def __init__(self, chunks: queue.Queue, reader: threading.Thread):
        self.chunks, self.reader, self.buf, self.done = chunks, reader, memoryview(b""), False

    def _next(self):
        while True:
            try:
                return self.chunks.get(timeout=0.1)
            except queue.Empty:
                if not self.reader.is_alive():  # stopped: its stream was abandoned (an error upstream)
                    raise EOFError("the read-ahead stopped before the end of this range") from None

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self.buf and not self.done:
            item = self._next()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                self.done = True
            else:
                self.buf = memoryview(item)
        n = min(len(buf), len(self.buf))
        buf[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n

    def close(self) -> None:
        try:
            while not self.done:  # what is left of this range, so that the next starts at its own bytes
                self.buf = memoryview(b"")
                self.readinto(bytearray(READ_BUFFER))
        except Exception:  # noqa: BLE001 -- a failed read was raised where it was read; closing only drains
            self.done = True
        super().close()


def read_ahead(reads: list[tuple], max_bytes: int, retry: Retry = DEFAULT_RETRY) -> Iterator[BinaryIO]:
    """Each (url, start, end, size, sha256, checked) range (``open_range``'s) as a stream, in order,
    its bytes read by a background thread up to ``max_bytes`` ahead of the reader, across range
    boundaries (the next range is asked for while the last is still being consumed). A stream must
    be read to its end before the next is taken."""
    chunks: queue.Queue = queue.Queue(max(2, max_bytes // READ_BUFFER))
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                chunks.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def reader():
        try:
            for url, start, end, size, sha256, checked in reads:
                with open_range(url, start, end, size=size, sha256=sha256, retry=retry, checked=checked) as f:
                    while chunk := f.read(READ_BUFFER):
                        if not put(chunk):
                            return
                if not put(None):
                    return
        except Exception as e:  # handed to the reader, who raises it where it reads
            put(e)

    thread = threading.Thread(target=reader, daemon=True, name="read-ahead")
    thread.start()
    try:
        for _ in reads:
            yield io.BufferedReader(_Ahead(chunks, thread), READ_BUFFER)
    finally:
        stop.set()
        thread.join()


def read_range(url: str, start: int, end: int) -> bytes:
    with open_range(url, start, end) as f:
        return f.read()


def iter_samples(url: str, shard, start: int, stop: int, bad: bool = False, *, frames: int | None = None,
                 motion: str = "none", fd: int | None = None, stream: BinaryIO | None = None,
                 retry: Retry = DEFAULT_RETRY) -> Iterator[tuple[int, Sample | DataFault]]:
    """Samples [start, stop) of a shard (a manifest ``ShardInfo``) as (index, ``Sample``), read
    sequentially through one open of their byte range (``stream``: those bytes already opened; ``fd``:
    the shard's descriptor), a chunk at a time, each checked against the manifest's digest and parsed
    by the format's schema (``shards.format.sample.parse``: ``frames`` frames, ``motion`` fields).
    A sample whose digest differs (``CorruptSample``) or whose members the schema refuses
    (``BadSample``) raises, or with ``bad`` comes as (index, that fault) and the reading goes on. A
    shard that ends early raises ``ShortShard``: only what is there is read into memory."""
    if start >= stop:
        return
    pos, found, where = shard.offsets[start], {}, f"{url}: shard {shard.name}"

    def note(error: CorruptSample) -> bytes:  # the bad sample's place kept, its bytes never handed on
        found[error.index] = error
        return bytes(shard.lengths[error.index])

    with open_samples(url, shard, pos, shard.offsets[stop - 1] + shard.lengths[stop - 1], fd, retry=retry,
                      stream=stream, replace=note if bad else None) as f:
        for i in range(start, stop):
            gap = read_upto(f, shard.offsets[i] - pos)  # between samples; empty in shards we write
            data = read_upto(f, shard.lengths[i])
            if len(gap) + len(data) < shard.offsets[i] + shard.lengths[i] - pos:
                raise ShortShard.of(url, shard, shard.keys[i], pos + len(gap) + len(data))
            pos = shard.offsets[i] + shard.lengths[i]
            if i in found:
                yield i, found.pop(i)
                continue
            try:
                yield i, parse(data, shard.keys[i], label=shard.labels[i], frames=frames, motion=motion,
                               where=where)
            except BadSample as e:
                if not bad:
                    raise
                yield i, e


def bad_facts(url: str, shard: str, key: str, index: int, fault: DataFault) -> dict:
    """What a reader that goes on without a bad sample records of it: where it is (``shard``: its
    name in the manifest), its one line (``line``) and, for a digest that differs, both digests."""
    return {"url": url, "shard": shard, "key": key, "index": index, "line": str(fault),
            **(fault.facts() if isinstance(fault, CorruptSample) else {})}
