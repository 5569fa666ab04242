"""The node-local shard cache: verified copies named by their SHA-256, each downloaded once per
node, within an optional byte budget that evicts the least recently used shard not in use.

Files: ``DIR/ab/<sha256>.tar`` (a verified copy), ``DIR/ab/<sha256>.tar.tmp-<random>`` (a
download in progress) and ``DIR/ab/<sha256>.tar.lock`` (exists while a download is under way).

* One download per shard: the process holding an exclusive ``flock`` on the ``.lock`` file
  downloads to a temporary name while hashing, and renames into place only when size and
  SHA-256 match the manifest; a killed download leaves no file under the final name. Other
  processes (ranks, loader workers) wait, and return as soon as the copy exists. The kernel
  drops a dead process's lock, so a waiter then takes the download over (deleting the dead
  one's temporary file). A waiter gives up with an error when the download it waits for makes
  no progress for ``stall_timeout`` seconds.
* In use: ``fetch`` returns a path pinned by a shared ``flock`` on the copy itself, held until
  ``release``. Eviction first takes an exclusive non-blocking lock, so a shard pinned by any
  process on the node is never evicted.
* Budget (``budget`` bytes, or ``$SHARD_CACHE_BUDGET`` such as ``500GB``): under a lock on
  the cache directory, copies and downloads in progress (preallocated to their full size) are
  summed, and unpinned copies deleted oldest-used first until the new shard fits; if it cannot
  fit, ``CacheFull``. ``reserve`` refuses up front a job whose one epoch needs more than the budget.

The locks are POSIX ``flock``: keep the cache on a node-local filesystem.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import time
import uuid
from contextlib import contextmanager

from .errors import CommandError
from .http_range import DEFAULT_RETRY, Retry
from .packing import parse_size
from .reading import READ_BUFFER, open_range

ENV_BUDGET = "SHARD_CACHE_BUDGET"


class CacheFull(CommandError, OSError):
    """The budget cannot hold what is asked (a command's one line, exit status 1)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShardCache:
    def __init__(self, directory: str, budget: int | str | None = None, stall_timeout: float = 120.0,
                 poll: float = 0.05, retry: Retry = DEFAULT_RETRY):
        self.directory = directory
        self.budget = parse_size(budget if budget is not None else os.environ.get(ENV_BUDGET) or None)
        self.stall_timeout, self.poll, self.retry = stall_timeout, poll, retry
        self._pins: dict[str, int] = {}
        os.makedirs(directory, exist_ok=True)

    def path(self, sha256: str) -> str:
        return os.path.join(self.directory, sha256[:2], f"{sha256}.tar")

    def reserve(self, nbytes: int, what: str = "one epoch's shards") -> None:
        """Refuse (``CacheFull``) when ``nbytes`` could never fit in the budget."""
        if self.budget is not None and nbytes > self.budget:
            raise CacheFull(f"{self.directory}: a cache budget of {self.budget:,} bytes cannot hold {what} "
                            f"({nbytes:,} bytes); raise ${ENV_BUDGET} or read without a cache")

    def fetch(self, url: str, sha256: str, size: int) -> str:
        """The local path of a verified copy of the shard at ``url``, downloaded if needed and
        pinned (never evicted) until ``release``."""
        dest = self.path(sha256)
        if sha256 in self._pins:
            return dest
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        while not self._pin(dest, sha256):
            lock = self._lock_download(dest, url)
            if lock is None:
                continue  # someone else's copy appeared
            try:
                if not os.path.exists(dest):
                    self._download(url, sha256, size, dest)
            finally:
                os.unlink(dest + ".lock")  # still ours: we hold the lock on this very file
                os.close(lock)
        return dest

    def release(self, sha256: str | None = None) -> None:
        """Unpin one shard, or all this cache object pinned."""
        for sha in [sha256] if sha256 else list(self._pins):
            fd = self._pins.pop(sha, None)
            if fd is not None:
                os.close(fd)

    # --- pins and download locks --------------------------------------------------------------
    def _pin(self, dest: str, sha256: str) -> bool:
        try:
            fd = os.open(dest, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an eviction decides about this file
        if os.fstat(fd).st_nlink == 0:  # evicted just before we locked it
            os.close(fd)
            return False
        os.utime(fd)  # recency for LRU
        self._pins[sha256] = fd
        return True

    def _lock_download(self, dest: str, url: str) -> int | None:
        """Hold the shard's download lock (returns its fd), or None once the copy exists."""
        lock_path = dest + ".lock"
        seen, since = None, time.monotonic()
        while True:
            if os.path.exists(dest):
                return None
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                now, state = time.monotonic(), self._partial_state(dest)
                if state != seen:
                    seen, since = state, now
                elif now - since > self.stall_timeout:
                    raise TimeoutError(f"{url}: another process has been downloading this shard to "
                                       f"{os.path.dirname(dest)} without progress for {now - since:.0f} s")
                time.sleep(self.poll)
                continue
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # we locked a lock file its finished owner had already removed: look again

    @staticmethod
    def _partial_state(dest: str) -> tuple:
        """What changes while a download progresses: its temporary files and their mtimes."""
        out = []
        for p in glob.glob(glob.escape(dest) + ".tmp-*"):
            try:
                out.append((p, os.stat(p).st_mtime_ns))
            except FileNotFoundError:
                pass
        return tuple(sorted(out))

    def _download(self, url: str, sha256: str, size: int, dest: str) -> None:
        for stale in glob.glob(glob.escape(dest) + ".tmp-*"):  # a dead downloader's; we hold the lock
            os.remove(stale)
        tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
        with self._directory_lock():
            self._make_room(size)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)  # the budget counts it from now on
            except OSError:
                os.ftruncate(fd, size)
        h, n = hashlib.sha256(), 0
        try:
            with open(fd, "wb") as out, open_range(url, 0, size, size=size, sha256=sha256, retry=self.retry) as src:
                while chunk := src.read(READ_BUFFER * 8):
                    h.update(chunk)
                    n += len(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())  # a copy under its final name must survive a crash whole
            if n != size or h.hexdigest() != sha256:
                raise OSError(f"{url}: staged copy has {n} bytes, sha256 {h.hexdigest()[:12]}; "
                              f"manifest says {size} bytes, sha256 {sha256[:12]}")
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    # --- budget ---------------------------------------------------------------------------------
    @contextmanager
    def _directory_lock(self):
        if self.budget is None:
            yield
            return
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _make_room(self, size: int) -> None:
        if self.budget is None:
            return
        self.reserve(size, "this shard")
        copies, used = [], 0
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(".tar") or ".tar.tmp-" in e.name:
                    st = e.stat(follow_symlinks=False)
                    used += st.st_size
                    if e.name.endswith(".tar"):
                        copies.append((st.st_mtime_ns, e.path, st.st_size))
        for _, path, nbytes in sorted(copies):
            if used + size <= self.budget:
                break
            if self._evict(path):
                used -= nbytes
        if used + size > self.budget:
            raise CacheFull(f"{self.directory}: {used:,} of the {self.budget:,}-byte budget are held by shards "
                            f"in use or being downloaded; no room for {size:,} more")

    @staticmethod
    def _evict(path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # pinned
        else:
            os.unlink(path)
            return True
        finally:
            os.close(fd)
