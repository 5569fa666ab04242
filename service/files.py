"""What the server serves of a shard set, and how it reads it.

Only names the catalog knows are served: a set's file table maps each name listed in its
manifest (the shards) plus ``manifest.json``, ``classes.txt`` and ``errors.jsonl`` to the size
and SHA-256 recorded for it. A file's SHA-256 (its ETag) is the one last computed from its
bytes, by the build that wrote it or by ``shard-service verify``, together with the file's size
and modification time then (``Entry.stamp``): a file that no longer looks like that is not served
until the set's manifest has been checked (a set rebuilt or edited in place is ``changed``: 409)
and the file hashed again (``Changed``; ``service.tables`` does both), so the ETag always
means the bytes, and a shard whose bytes are not the manifest's goes out with an ETag that no
checking client accepts. A request's path is only ever looked up in that table; it is
never joined onto a filesystem path. Local files are opened component by component from the
set's directory with ``O_NOFOLLOW``, so a symbolic link planted inside a set is refused, and
only regular files of the recorded size are served. Remote sets (fsspec URLs) are streamed
through the same range reader the trainer uses.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
from dataclasses import dataclass

from fsspec.core import url_to_fs

from shards.catalog import Record
from shards.catalog.condition import changed, difference
from shards.format.manifest import MANIFEST_NAME, Manifest
from shards.io import storage

log = logging.getLogger("service.files")
CONTENT_TYPES = {".tar": "application/x-tar", ".json": "application/json",
                 ".txt": "text/plain; charset=utf-8",
                 ".jsonl": "application/x-ndjson"}


class Refused(Exception):
    """A file the server will not serve; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Changed(Exception):
    """A local file whose size or modification time differ from when its bytes were last hashed."""


@dataclass(frozen=True)
class Entry:
    size: int
    sha256: str  # the manifest's (or for the small files, the catalog's)
    stamp: tuple[int, int] | None = None  # (size, mtime_ns) of the file when last hashed; None: not known
    hashed: str | None = None  # the SHA-256 its bytes had then, when known

    @property
    def etag(self) -> str:
        return f'"{self.hashed or self.sha256}"'


def clean_name(name: str) -> bool:
    """A relative '/'-separated path with no empty, '.' or '..' part, no backslash, no NUL."""
    return bool(name) and "\\" not in name and "\0" not in name and not name.startswith("/") and \
        all(part not in ("", ".", "..") for part in name.split("/"))


def checked_manifest(rec: Record) -> Manifest:
    """A ready set's manifest, refused (409, the set ``changed``) unless it still has the SHA-256
    the catalog recorded."""
    data = storage.read_bytes(storage.join(rec.location, MANIFEST_NAME))
    problem = difference(rec, data)
    if problem:
        raise Refused(409, changed(rec, problem).sentence(rec))
    return Manifest.from_json(data, base=rec.location)


def file_table(rec: Record) -> dict[str, Entry]:
    """name -> Entry for every file of a ready set, from its manifest, checked against the catalog;
    each with its size, modification time and SHA-256 as last hashed (the record's ``verified_files``)."""
    table = {}
    for name, (size, sha) in rec.files.items():
        stamp = rec.verified_files.get(name)
        table[name] = Entry(size, sha, None if stamp is None else tuple(stamp[:2]), None if stamp is None
                            else stamp[2])
    for split in checked_manifest(rec).splits.values():
        for shard in split.shards:
            if clean_name(shard.name):
                size, mtime, sha = rec.verified_files.get(shard.name, (None, None, None))
                table[shard.name] = Entry(shard.bytes, shard.sha256, None if size is None else (size, mtime),
                                          sha)
            else:
                log.warning("%s: manifest names a shard %r outside the set; not served", rec.location,
                            shard.name)
    return table


def open_local(root: str, name: str, entry: Entry | None) -> int:
    """A descriptor of ``root/name``, opened without following any symbolic link below ``root``;
    ``entry``: what the file must look like (None: any regular file)."""
    parts = name.split("/")
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Refused(404, f"the set's directory {root} is gone") from None
    try:
        for part in parts[:-1]:
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = sub
        f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except FileNotFoundError:
        raise Refused(404, f"{name} is missing from the set's directory") from None
    except (NotADirectoryError, OSError) as e:  # ELOOP: a symbolic link
        raise Refused(403, f"{name} is not a regular file inside the set ({os.strerror(e.errno)})") from None
    finally:
        os.close(fd)
    st = os.fstat(f)
    if stat.S_ISREG(st.st_mode) and entry and entry.stamp and entry.stamp != (st.st_size, st.st_mtime_ns):
        os.close(f)
        raise Changed(name)
    if not stat.S_ISREG(st.st_mode) or (entry and st.st_size != entry.size):
        os.close(f)
        what = ("not a regular file" if not stat.S_ISREG(st.st_mode)
                else f"{st.st_size} bytes, recorded {entry.size}")
        raise Refused(403 if not stat.S_ISREG(st.st_mode) else 500, f"{name} on disk: {what}")
    return f


def hash_local(root: str, name: str) -> list:
    """[size, mtime_ns, sha256] of a set's local file (opened as ``open_local`` does), the stamp
    taken before reading."""
    fd = open_local(root, name, None)
    try:
        st, h, pos = os.fstat(fd), hashlib.sha256(), 0
        while chunk := os.pread(fd, 8 << 20, pos):
            h.update(chunk)
            pos += len(chunk)
    finally:
        os.close(fd)
    return [st.st_size, st.st_mtime_ns, h.hexdigest()]


def presign(url: str, seconds: int) -> str | None:
    """A presigned HTTP(S) URL of an object, valid ``seconds``; None where the store signs nothing."""
    fs, path = url_to_fs(url)
    try:
        signed = fs.sign(path, expiration=seconds)
    except NotImplementedError:
        return None
    return signed if signed.startswith(("http://", "https://")) else None


def content_type(name: str) -> str:
    return CONTENT_TYPES.get(os.path.splitext(name)[1], "application/octet-stream")
