"""What the server serves of a shard set, and how it reads it.

Only names the catalog knows are served: a set's file table maps each name listed in its
manifest (the shards) plus ``manifest.json``, ``classes.txt`` and ``errors.jsonl`` to the size
and SHA-256 recorded for it. A request's path is only ever looked up in that table; it is
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

from shards import storage
from shards.manifest import MANIFEST_NAME, Manifest

log = logging.getLogger("service.files")
CONTENT_TYPES = {".tar": "application/x-tar", ".json": "application/json", ".txt": "text/plain; charset=utf-8",
                 ".jsonl": "application/x-ndjson"}


class Refused(Exception):
    """A file the server will not serve; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Entry:
    size: int
    sha256: str

    @property
    def etag(self) -> str:
        return f'"{self.sha256}"'


def clean_name(name: str) -> bool:
    """A relative '/'-separated path with no empty, '.' or '..' part, no backslash, no NUL."""
    return bool(name) and "\\" not in name and "\0" not in name and not name.startswith("/") and \
        all(part not in ("", ".", "..") for part in name.split("/"))


def checked_manifest(location: str, manifest_sha256: str) -> Manifest:
    """A ready set's manifest, refused unless it still has the SHA-256 the catalog recorded."""
    data = storage.read_bytes(storage.join(location, MANIFEST_NAME))
    if hashlib.sha256(data).hexdigest() != manifest_sha256:
        raise Refused(500, f"{location}: manifest.json changed since the set was registered; "
                           "run `shard-service verify` and rebuild it")
    return Manifest.from_json(data, base=location)


def file_table(location: str, files: dict, manifest_sha256: str) -> dict[str, Entry]:
    """name -> Entry for every file of a ready set, from its manifest, checked against the catalog."""
    table = {name: Entry(size, sha) for name, (size, sha) in files.items()}
    for split in checked_manifest(location, manifest_sha256).splits.values():
        for shard in split.shards:
            if clean_name(shard.name):
                table[shard.name] = Entry(shard.bytes, shard.sha256)
            else:
                log.warning("%s: manifest names a shard %r outside the set; not served", location, shard.name)
    return table


def open_local(root: str, name: str, entry: Entry) -> int:
    """A descriptor of ``root/name``, opened without following any symbolic link below ``root``."""
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
    if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
        os.close(f)
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"{st.st_size} bytes, recorded {entry.size}"
        raise Refused(403 if not stat.S_ISREG(st.st_mode) else 500, f"{name} on disk: {what}")
    return f


def content_type(name: str) -> str:
    return CONTENT_TYPES.get(os.path.splitext(name)[1], "application/octet-stream")
