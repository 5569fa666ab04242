"""fsspec helpers: URL joining, local paths, whole-file reads and atomic writes (temp name, then rename).

The bottom layer of ``shards``: it imports nothing of the project, and no HTTP client
(``shards.reading`` and ``shards.http_range`` build on it, not the other way round).
"""
from __future__ import annotations

import os
import re
import uuid

from fsspec.core import url_to_fs

TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{8}$")  # the suffix of a file being written, before its rename

def join(base: str, *parts: str) -> str:
    """Join path components onto a local path or an fsspec URL."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def local_path(url: str) -> str | None:
    """The OS path of a local URL (plain path or ``file://``), None for anything remote."""
    if "://" not in url:
        return url
    return url[len("file://"):] if url.startswith("file://") else None


def open_fd(url: str) -> int:
    """One read-only descriptor for a local file, with no stat (Python's ``open`` would add two
    ``fstat``); loader workers forked after it share it."""
    return os.open(local_path(url), os.O_RDONLY | os.O_CLOEXEC)


def is_local(url: str) -> bool:
    fs, _ = url_to_fs(url)
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def exists(url: str) -> bool:
    fs, path = url_to_fs(url)
    return fs.exists(path)


def read_bytes(url: str) -> bytes:
    """The whole file: a local one with one open and no stat, a remote one with one request
    (fsspec's ``cat_file``: over HTTP a GET, and no HEAD)."""
    if local_path(url) is not None:
        fd = open_fd(url)
        try:
            return b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
        finally:
            os.close(fd)
    fs, path = url_to_fs(url)
    return fs.cat_file(path)


def _temporary(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"


def makedirs(url: str) -> None:
    fs, path = url_to_fs(url)
    fs.makedirs(path, exist_ok=True)


def atomic_write(url: str, data: bytes) -> None:
    """Write ``data`` so that ``url`` is either absent, old, or complete: never partial."""
    fs, path = url_to_fs(url)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = _temporary(path)
    if is_local(url):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        with fs.open(tmp, "wb") as f:
            f.write(data)
        fs.mv(tmp, path)


class AtomicWriter:
    """A file object for streaming writes that appears under its final name only on commit."""

    def __init__(self, url: str):
        self.fs, self.path = url_to_fs(url)
        parent = self.path.rsplit("/", 1)[0] if "/" in self.path else ""
        if parent:
            self.fs.makedirs(parent, exist_ok=True)
        self.tmp = _temporary(self.path)
        self.f = self.fs.open(self.tmp, "wb")

    def write(self, data: bytes) -> int:
        return self.f.write(data)

    def commit(self) -> None:
        self.f.flush()
        if hasattr(self.f, "fileno"):
            try:
                os.fsync(self.f.fileno())
            except (OSError, ValueError, AttributeError):
                pass
        self.f.close()
        self.fs.mv(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        try:
            self.fs.rm(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "AtomicWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
