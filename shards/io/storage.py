"""fsspec helpers: URL joining, local paths, whole-file reads and atomic writes (temp name, then rename).

The bottom layer of ``shards``: it imports nothing of the project but its vocabulary of refusals
(``shards.base.errors``), and no HTTP client of the project (``shards.read.reading`` and
``shards.io.http_range`` build on it, not the other way round). A whole file over HTTP (a manifest, a set's
record) is one GET with the standard library's client, so reading a set from the service needs neither aiohttp
nor fsspec's HTTP filesystem (the reading-only install has neither). A write that fails, a full disk included,
leaves no temporary file behind; a full disk is ``NoSpace``, one line naming the path and the bytes needed and
free.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from contextlib import contextmanager

import fsspec.config
from fsspec.core import url_to_fs

from ..base.errors import NoSpace

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


def read_bytes(url: str, limit: int | None = None) -> bytes:
    """The whole file (at most ``limit`` bytes of it: a caller that bounds what it reads sees a
    larger file as ``limit`` bytes and refuses it): a local one with one open and no stat, an
    HTTP(S) one with one GET (and no HEAD; 404 is ``FileNotFoundError``), any other with fsspec's
    ``cat_file``."""
    if local_path(url) is not None:
        fd = open_fd(url)
        try:
            chunks, got = [], 0
            while limit is None or got < limit:
                chunk = os.read(fd, min(1 << 20, limit - got) if limit is not None else 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    if url.startswith(("http://", "https://")):
        import urllib.error  # only here: the path helpers load no HTTP client (tests/test_layering.py)
        import urllib.request

        request = urllib.request.Request(url, headers=http_headers(url.split(":", 1)[0]))
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.read(limit) if limit is not None else response.read()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise FileNotFoundError(f"{url}: not found (404)") from None
            raise
    fs, path = url_to_fs(url)
    if limit is None:
        return fs.cat_file(path)
    with fs.open(path, "rb") as f:
        return f.read(limit)


def http_headers(scheme: str) -> dict:
    """The headers fsspec's configuration gives every HTTP request (``FSSPEC_HTTP_HEADERS``, or
    ``~/.config/fsspec/http.json``): a service's read token, for example."""
    conf = fsspec.config.conf
    return {**conf.get("http", {}).get("headers", {}), **conf.get(scheme, {}).get("headers", {})}


def _temporary(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"


def makedirs(url: str) -> None:
    fs, path = url_to_fs(url)
    fs.makedirs(path, exist_ok=True)


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no room: the disk, a quota, RLIMIT_FSIZE


def free_bytes(url: str) -> int | None:
    """Bytes free to this process on the filesystem of a local ``url`` (its nearest existing
    directory), None for a remote one."""
    path = local_path(url)
    if path is None:
        return None
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


@contextmanager
def room_for(url: str, needed: int, cleanup=lambda: None, *, error=NoSpace, advice: str = ""):
    """Around a write of ``needed`` bytes to ``url``: whatever fails, ``cleanup`` runs first (removing
    the temporary file, so the bytes free are counted without it); no room on the filesystem is
    ``error`` (a ``NoSpace``), one line naming the path, the bytes needed and free, and ``advice``."""
    try:
        yield
    except BaseException as e:
        cleanup()
        if not isinstance(e, OSError) or e.errno not in FULL:
            raise
        free = free_bytes(url)
        raise error(f"{url}: {os.strerror(e.errno).lower()}: the write needs {needed:,} bytes"
                    + (f", {free:,} are free" if free is not None else "")
                    + (f"; {advice}" if advice else "")) from None


def _make_parent(fs, path: str) -> None:
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)


def _remove(fs, path: str) -> None:
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass


def atomic_write(url: str, data: bytes) -> None:
    """Write ``data`` so that ``url`` is either absent, old, or complete: never partial, and no
    temporary file left when the write fails."""
    fs, path = url_to_fs(url)
    tmp = _temporary(path)
    with room_for(url, len(data), lambda: _remove(fs, tmp)):
        _make_parent(fs, path)
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
    """A file object for streaming writes that appears under its final name only on commit; a
    failed write or commit (``NoSpace`` for no room: ``size``, when given, is the bytes it needs)
    leaves nothing behind."""

    def __init__(self, url: str, size: int | None = None):
        self.url, self.size, self.written = url, size, 0
        self.fs, self.path = url_to_fs(url)
        self.tmp = _temporary(self.path)
        with room_for(url, size or 0):
            _make_parent(self.fs, self.path)
            self.f = self.fs.open(self.tmp, "wb")

    def _room(self, more: int = 0):
        self.written += more
        return room_for(self.url, max(self.size or 0, self.written), self.abort)

    def write(self, data: bytes) -> int:
        with self._room(len(data)):
            return self.f.write(data)

    def commit(self) -> None:
        with self._room():
            self.f.flush()
            if hasattr(self.f, "fileno"):
                try:
                    os.fsync(self.f.fileno())
                except (OSError, ValueError, AttributeError) as e:  # no descriptor, or none to sync
                    if getattr(e, "errno", None) in FULL:
                        raise
            self.f.close()
            self.fs.mv(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self.f.close()
        except OSError:
            pass  # the buffered bytes that did not fit: the failure being aborted
        finally:
            _remove(self.fs, self.tmp)

    def __enter__(self) -> "AtomicWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
