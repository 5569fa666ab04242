"""Byte-range reads of shards, local or over fsspec, and a node-local shard cache.

Readers learn sizes and offsets from the manifest, so a read is one open of one byte range:
no stat, no directory listing. Local files are read with ``pread`` on a plain descriptor
(Python's ``open`` would add an ``fstat``); a descriptor can be opened once and shared by
forked loader workers. HTTP ranges are one streamed GET with a ``Range`` header, every
response checked and retried (``shards.http_range``). Other fsspec filesystems (s3, gcs,
memory) are read with one ranged ``cat_file`` per chunk: object stores get no metadata
request (a HEAD) per range, since the manifest already gave the size. ``open_samples`` checks
each sample of a range against the manifest's digest on the way (``shards.digests``). The
node-local shard cache is ``shards.cache``.
"""
from __future__ import annotations

import bisect
import io
import os
from typing import BinaryIO

from fsspec.core import url_to_fs

from .digests import CheckedSamples
from .http_range import DEFAULT_RETRY, HTTPRange, RangeError, Retry
from .storage import local_path, open_fd

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
    length and retried like HTTP ranges."""

    def __init__(self, url: str, start: int, end: int, retry: Retry):
        self.url, self.pos, self.end, self.retry = url, start, end, retry
        self.fs, self.path = url_to_fs(url)
        self.buf, self.at = b"", 0

    def readable(self) -> bool:
        return True

    def _fetch(self) -> None:
        want = min(OBJECT_CHUNK, self.end - self.pos)
        for attempt in range(1, self.retry.attempts + 1):
            try:
                data = self.fs.cat_file(self.path, start=self.pos, end=self.pos + want)
            except FileNotFoundError:
                raise FileNotFoundError(f"{self.url}: not found") from None
            except OSError as e:
                problem = f"{type(e).__name__}: {e}"
            else:
                if len(data) == want:
                    self.buf, self.at = data, 0
                    return
                problem = f"{len(data)} bytes, expected {want}"
            if attempt < self.retry.attempts:
                self.retry.sleep(attempt)
        raise RangeError(f"{self.url}: bytes {self.pos}-{self.pos + want - 1}: {problem}; "
                         f"gave up after {self.retry.attempts} attempts")

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
               sha256: str | None = None, retry: Retry = DEFAULT_RETRY) -> BinaryIO:
    """A readable stream of exactly bytes [start, end) of ``url``.

    ``fd``: an already open descriptor of the same local file, used instead of opening it.
    ``size``, ``sha256``: the file's size and digest from the manifest, which HTTP answers
    must agree with.
    """
    path = local_path(url)
    if fd is not None or path is not None:
        owns = fd is None
        if owns:
            fd = open_fd(path)
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
        return io.BufferedReader(_PreadFile(fd, start, end, owns), READ_BUFFER)
    if url.startswith(("http://", "https://")):
        return io.BufferedReader(HTTPRange(url, start, end, size, sha256, retry), READ_BUFFER)
    return io.BufferedReader(_Chunked(url, start, end, retry), READ_BUFFER)


def open_samples(url: str, shard, start: int, end: int, fd: int | None = None, *,
                 retry: Retry = DEFAULT_RETRY) -> BinaryIO:
    """``open_range`` of bytes [start, end) of a shard (a manifest ``ShardInfo``) that begin and end
    at sample boundaries, every sample checked against the manifest's digest (format /2 manifests;
    older ones have none, and their ranges are read unchecked)."""
    opener = lambda a, b: open_range(url, a, b, fd, size=shard.bytes, sha256=shard.sha256, retry=retry)  # noqa: E731
    if not shard.digests:
        return opener(start, end)
    first = bisect.bisect_left(shard.offsets, start)
    last = bisect.bisect_left(shard.offsets, end) - 1
    if first > last or shard.offsets[first] != start or shard.offsets[last] + shard.lengths[last] != end:
        raise ValueError(f"{url}: bytes {start}-{end - 1} are not whole samples of {shard.name}")
    return io.BufferedReader(CheckedSamples(url, shard, first, last, opener), READ_BUFFER)


def read_range(url: str, start: int, end: int) -> bytes:
    with open_range(url, start, end) as f:
        return f.read()


def iter_samples(url: str, shard, start: int, stop: int):
    """Samples [start, stop) of a shard (a manifest ``ShardInfo``) as (index, tar bytes), read
    sequentially through one open of their byte range."""
    if start >= stop:
        return
    pos = shard.offsets[start]
    with open_samples(url, shard, pos, shard.offsets[stop - 1] + shard.lengths[stop - 1]) as f:
        for i in range(start, stop):
            f.read(shard.offsets[i] - pos)  # a gap between samples; empty in shards we write
            data = f.read(shard.lengths[i])
            if len(data) < shard.lengths[i]:
                raise EOFError(f"{url}: ends inside sample {shard.keys[i]}")
            pos = shard.offsets[i] + shard.lengths[i]
            yield i, data
