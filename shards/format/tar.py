"""Deterministic tar members for WebDataset samples.

A sample is a run of consecutive tar members ``<key>.<suffix>`` (for clips:
``<key>.00.jpg`` ... ``<key>.07.jpg``, ``<key>.cls``, ``<key>.json``). Headers carry fixed
mtime, owner and mode so the same bytes in give the same archive out on any machine. A
sample's members are contiguous, so its byte range in a shard is itself a valid tar stream.
"""
from __future__ import annotations

import re
import tarfile

BLOCK = 512
RECORD = 20 * BLOCK  # tar's default record size; archives end padded to it
_KEY_OK = re.compile(r"[^A-Za-z0-9_\-]")


def sanitize_key(text: str) -> str:
    """A WebDataset key: no dots (they separate key from suffix), no slashes, no spaces."""
    return _KEY_OK.sub("_", text)


def member_bytes(name: str, data: bytes) -> bytes:
    """One tar member: header block(s) plus data padded to the 512-byte block size."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    header = info.tobuf(format=tarfile.GNU_FORMAT, encoding="utf-8", errors="strict")
    pad = (-len(data)) % BLOCK
    return header + data + b"\0" * pad


def sample_bytes(key: str, members: list[tuple[str, bytes]]) -> bytes:
    """All members of one sample, in the given order, as contiguous tar bytes."""
    if "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
    return b"".join(member_bytes(f"{key}.{suffix}", data) for suffix, data in members)


def end_of_archive(archive_size: int) -> bytes:
    """Two zero blocks, then zero padding to a whole record, as GNU tar writes them."""
    size = archive_size + 2 * BLOCK
    return b"\0" * (2 * BLOCK + (-size) % RECORD)
