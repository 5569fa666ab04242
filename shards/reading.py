"""Byte-range reads of shards, local or over fsspec, and a node-local shard cache.

Readers learn sizes and offsets from the manifest, so a read is one open of one byte range:
no stat, no directory listing. Local files are read with ``pread`` on a plain descriptor
(Python's ``open`` would add an ``fstat``); a descriptor can be opened once and shared by
forked loader workers. HTTP ranges are one streamed GET with a ``Range`` header; other
fsspec filesystems (s3, gcs, memory) seek and read through fsspec's own buffering.
"""
from __future__ import annotations

import hashlib
import io
import os
import uuid
from typing import BinaryIO

from fsspec.core import url_to_fs

READ_BUFFER = 1 << 20  # bytes per read call on local files; tar parsing asks for 10 KiB at a time


def local_path(url: str) -> str | None:
    """The OS path of a local URL (plain path or ``file://``), None for anything remote."""
    if "://" not in url:
        return url
    return url[len("file://"):] if url.startswith("file://") else None


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

    def close(self) -> None:
        if self.owns_fd and not self.closed:
            os.close(self.fd)
        super().close()


class _Bounded(io.RawIOBase):
    """At most ``length`` bytes of an already positioned file object."""

    def __init__(self, f: BinaryIO, length: int):
        self.f, self.left = f, length

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        data = self.f.read(min(len(buf), self.left))
        buf[: len(data)] = data
        self.left -= len(data)
        return len(data)

    def close(self) -> None:
        self.f.close()
        super().close()


def open_fd(url: str) -> int:
    """One read-only descriptor for a local shard (for sharing among forked workers)."""
    return os.open(local_path(url), os.O_RDONLY | os.O_CLOEXEC)


def open_range(url: str, start: int, end: int, fd: int | None = None) -> BinaryIO:
    """A readable stream of exactly bytes [start, end) of ``url``.

    ``fd``: an already open descriptor of the same local file, used instead of opening it.
    """
    path = local_path(url)
    if fd is not None or path is not None:
        owns = fd is None
        if owns:
            fd = open_fd(path)
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
        return io.BufferedReader(_PreadFile(fd, start, end, owns), READ_BUFFER)
    fs, fspath = url_to_fs(url)
    if url.startswith(("http://", "https://")):
        # block_size=0: one streamed GET for the whole range; size given so no HEAD is made
        f = fs.open(fspath, "rb", block_size=0, size=end, headers={"Range": f"bytes={start}-{end - 1}"})
        if f.r.status != 206:
            f.close()
            raise OSError(f"{url}: server answered {f.r.status} to a byte-range request")
        return io.BufferedReader(_Bounded(f, end - start), READ_BUFFER)
    f = fs.open(fspath, "rb", block_size=min(end - start, 64 << 20) or 1)
    f.seek(start)
    return io.BufferedReader(_Bounded(f, end - start), READ_BUFFER)


def read_range(url: str, start: int, end: int) -> bytes:
    with open_range(url, start, end) as f:
        return f.read()


class ShardCache:
    """Shards staged once to a node-local directory, named by their SHA-256, reused across runs.

    A shard is copied to a temporary name while its SHA-256 and size are checked, and renamed
    into place only if both match: a file under its final name is a verified copy. Ranks and
    workers of a node that stage the same shard at once each write their own temporary file;
    the rename makes the last one win with identical bytes.
    """

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def path(self, sha256: str) -> str:
        return os.path.join(self.directory, sha256[:2], f"{sha256}.tar")

    def fetch(self, url: str, sha256: str, size: int) -> str:
        """The local path of a verified copy of the shard at ``url``, staging it if needed."""
        dest = self.path(sha256)
        if os.path.exists(dest):
            return dest
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
        h, n = hashlib.sha256(), 0
        try:
            with open_range(url, 0, size) as src, open(tmp, "wb") as out:
                while chunk := src.read(READ_BUFFER * 8):
                    h.update(chunk)
                    n += len(chunk)
                    out.write(chunk)
            if n != size or h.hexdigest() != sha256:
                raise OSError(f"{url}: staged copy has {n} bytes, sha256 {h.hexdigest()[:12]}; "
                              f"manifest says {size} bytes, sha256 {sha256[:12]}")
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return dest


def iter_samples(url: str, shard, start: int, stop: int):
    """Samples [start, stop) of a shard (a manifest ``ShardInfo``) as (index, tar bytes), read
    sequentially through one open of their byte range."""
    if start >= stop:
        return
    pos = shard.offsets[start]
    with open_range(url, pos, shard.offsets[stop - 1] + shard.lengths[stop - 1]) as f:
        for i in range(start, stop):
            f.read(shard.offsets[i] - pos)  # a gap between samples; empty in shards we write
            data = f.read(shard.lengths[i])
            if len(data) < shard.lengths[i]:
                raise EOFError(f"{url}: ends inside sample {shard.keys[i]}")
            pos = shard.offsets[i] + shard.lengths[i]
            yield i, data
