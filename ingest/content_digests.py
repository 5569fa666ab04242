"""Content digests of a build's inputs, for ``--fingerprint content``.

What identifies a build's inputs is their ``stat`` (path, size, modification stamp) or their
``content`` (the SHA-256 of every input's bytes).

``stat`` (the default) costs one listing and trusts that a file of unchanged size and modification
time is unchanged: a corrected video copied with its mtime kept (``cp -p``, ``rsync -t``, a tar
extract) passes for the old one, and the same videos under another path count as other inputs.
``content`` reads every byte, in the build's tasks (on Ray where the data is; the driver only
plans), and names each input by its relative path, digest and label: a corrected video is a new
input, and the same videos under another source directory are the same inputs.

Digests are cached in one SQLite file on the machine that runs the build, keyed by the URL and
what a listing says of the file: size, mtime, ctime and inode for a local file, size and the
store's ETag or update time for an object (an object with neither is hashed every time). ctime
is in the key because ``cp -p`` rewrites a file in place, keeping its inode, size and mtime, and
only the ctime, which no one can set, moves. The cache lives beside neither the output nor the
catalog: a build asked for again into another ``--out`` must find its set without reading every
input again, and a build without a catalog hashes too. Losing the cache costs a rehash, nothing
else. SQLite needs a local filesystem for its locks: point ``--hash-cache`` at local disk where
the home directory is on NFS.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
from contextlib import closing

from fsspec.core import url_to_fs

from shards.io import storage

from .sources import Video, stamp_of

log = logging.getLogger("ingest.content_digests")
FINGERPRINTS = ("stat", "content")
CHUNK = 8 << 20  # bytes per read while hashing
TASKS_PER_WORKER = 4  # hashing tasks per parallel worker: enough to even out file sizes


def default_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kinetics-fast", "content-hashes.sqlite")


def _key(size: int, stamp, ctime: float | None = None, inode: int = 0) -> str | None:
    """What a listing says of a file, the cache's key besides its URL; None: not cacheable."""
    return None if stamp is None else json.dumps([size, stamp, ctime, inode])


class DigestCache:
    """URL -> (key, SHA-256 hex) in one SQLite file; a digest is only returned for an unchanged key."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.db = sqlite3.connect(path, timeout=60, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS digests (url TEXT PRIMARY KEY, key TEXT NOT NULL, "
                        "sha256 TEXT NOT NULL)")

    def get(self, videos: list[Video]) -> dict[str, str]:
        keys = {v.url: _key(v.size, v.stamp, v.ctime, v.inode) for v in videos}
        wanted = {url: key for url, key in keys.items() if key is not None}
        urls, found = list(wanted), {}
        for i in range(0, len(urls), 500):
            chunk = urls[i:i + 500]
            rows = self.db.execute("SELECT url, key, sha256 FROM digests "
                                   f"WHERE url IN ({','.join('?' * len(chunk))})", chunk)
            found.update({url: sha for url, key, sha in rows if wanted[url] == key})
        return found

    def put(self, rows: list[tuple[str, str, str]]) -> None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany("INSERT OR REPLACE INTO digests (url, key, sha256) VALUES (?, ?, ?)", rows)

    def close(self) -> None:
        self.db.close()


def _hash_stream(read) -> str:
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := read(buf):
        h.update(view[:n])
    return h.hexdigest()


def hash_file(video: Video) -> tuple[str, str | None] | None:
    """(SHA-256 hex, cache key of what was read) of one input, run in a build task; the key is None
    when the file changed while it was read, or it has no stamp; None when it cannot be read (the
    decode will record why)."""
    path = storage.local_path(video.url)
    try:
        if path is not None:
            fd = storage.open_fd(video.url)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                before = os.fstat(fd)
                digest = _hash_stream(lambda buf: os.readv(fd, [buf]))
                after = os.fstat(fd)
            finally:
                os.close(fd)
            unchanged = (before.st_size, before.st_mtime_ns, before.st_ctime_ns) == \
                (after.st_size, after.st_mtime_ns, after.st_ctime_ns)
            return digest, (_key(after.st_size, after.st_mtime, after.st_ctime, after.st_ino)
                            if unchanged else None)
        fs, fpath = url_to_fs(video.url)
        info = fs.info(fpath)
        with fs.open(fpath, "rb", block_size=CHUNK) as f:
            digest = _hash_stream(f.readinto)
        return digest, _key(info.get("size") or 0, stamp_of(info))
    except (OSError, ValueError):
        return None


def hash_files(videos: list[Video]) -> list[tuple[str, str | None] | None]:
    return [hash_file(v) for v in videos]


def digests(videos: list[Video], cache_path: str | None, tasks) -> dict[str, str]:
    """URL -> SHA-256 hex of every readable file among ``videos``: from the cache where its key is
    unchanged, else hashed by ``tasks`` (``ingest.tasks.runtime``) and cached."""
    files = [v for v in videos if v.kind == "file"]
    with closing(DigestCache(cache_path or default_cache())) as cache:
        found = cache.get(files)
        todo = [v for v in files if v.url not in found]
        log.info("content fingerprint: %d of %d inputs' digests cached, hashing %d (%.1f GB)", len(found),
                 len(files), len(todo), sum(v.size for v in todo) / 1e9)
        per_task = max(1, -(-len(todo) // (TASKS_PER_WORKER * tasks.parallel)))
        batches = [todo[i:i + per_task] for i in range(0, len(todo), per_task)]
        refs = [tasks.submit(hash_files, batch) for batch in batches]
        fresh = []
        for batch, ref in zip(batches, refs):
            results, _node = tasks.result(ref)
            for video, result in zip(batch, results):
                if result is not None:
                    found[video.url] = result[0]
                    if result[1] is not None:
                        fresh.append((video.url, result[1], result[0]))
        cache.put(fresh)
    return found
