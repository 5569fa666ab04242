"""The node-local shard cache: verified copies of shards (or of the byte ranges of them a node
owns), each downloaded once per node, streamed through one byte budget that every process using
the directory shares.

Files: ``DIR/ab/<sha256>.tar`` (a whole shard), ``DIR/ab/<sha256>.<start>-<end>.tar`` (bytes
[start, end) of it, a piece), ``DIR/ab/<sha256>.damaged.tar`` (a whole shard whose bytes are not
the manifest's, kept aside for readers that check each sample: below), ``<name>.tmp-<random>``
(a download in progress),
``<name>.lock`` (exists while a download is under way) and ``<name>.unavailable`` (the last
download gave up on its source). The files are the ledger: no process
keeps an account another could not read from the directory.

* One download per copy: the process holding an exclusive ``flock`` on the ``.lock`` file
  downloads to a temporary name, and renames into place only when it is whole and verified (a
  whole shard: size and SHA-256 from the manifest; a piece: its length, and the range checks of
  ``shards.io.http_range``, which include the shard's size and SHA-256 ETag); a killed download
  leaves no file under the final name. The downloader holds a lease that follows its progress:
  every ``heartbeat`` seconds it touches the ``.lock`` file if bytes arrived since the last beat
  (a chunk of ``READ_BUFFER``, 1 MiB) or it is waiting on purpose (for room in the budget, a
  retry's backoff, a server's ``Retry-After``, a source that is down). Other processes (ranks, loader workers,
  other jobs) wait for as long as the lease is renewed, and fail when it has not been for ``lease``
  seconds: a downloader that is hung, or alive but getting no byte (a stalled connection, a
  transfer slower than a chunk per lease), does not keep its waiters forever. The kernel drops a
  dead process's lock, so a waiter then takes the download over (deleting the dead one's
  temporary file).
* A source that is down: the downloader waits for it as every reader does (``shards.io.http_range``:
  backoff up to the source deadline, one log line when the wait starts and one when it ends),
  renewing its lease meanwhile, so the node's other processes wait behind it. If it gives up
  (``SourceUnavailable``) it leaves ``<name>.unavailable`` holding its one-line reason, and every
  process that was already waiting for that copy gives up with the same line instead of starting
  a deadline of its own: one node, one clock. The next download that gets through deletes it.
* In use: ``fetch`` returns a path pinned by a shared ``flock`` on the copy itself, held until
  ``release`` (a forked child, such as a loader worker, starts without its parent's pins). Eviction first
  takes an exclusive non-blocking lock, so a copy pinned by any process on the node is never evicted.
* Budget (``budget`` bytes, or ``$SHARD_CACHE_BUDGET`` such as ``500GB``), one per directory:
  under a lock on the directory, copies and downloads in progress (preallocated to their full
  size) are summed, and unpinned copies deleted oldest-used first until the new one fits. When
  pins of other processes hold the room, the download waits for them to let go (a budget
  smaller than an epoch's share streams through); only what this process pins itself could never
  make room, and that is ``CacheFull``. ``reserve`` refuses up front, before any download, a
  budget that cannot hold what the node's readers pin at once (their lookahead).
* A damaged shard: a whole copy whose SHA-256 is not the manifest's is never kept under the
  shard's name. For a piece whose reader checks every sample against the manifest's per-sample
  digests (``Piece.checked``: ``shards.format.digests.CheckedSamples``, the trainer's loader) it is
  kept aside as ``<sha256>.damaged.tar`` and handed out as the shard's copy: the reader uses its good
  samples and reads each bad one again from the source (still bad: a bad sample for
  ``--max-bad-samples``; repaired since: the source's good bytes), so one flipped sample costs that
  sample, not the run. The node's other readers of the shard take the same copy (one download per
  node, as for a sound one); readers that cannot check samples never see it (``ShardChanged``). It
  is counted in the budget and evicted as any copy.
* A disk that fills before the budget does (no budget, or one larger than the disk) is
  ``CacheDiskFull``: a ``DataFault`` whose one line names the copy, the bytes needed and free, and
  the remedy; the preallocated temporary file is removed.
* Streaming: ``stream(pieces, lookahead)`` yields the copies in the order asked, downloading in a
  background thread up to ``lookahead`` copies ahead of the reader (the first is there after one
  download), each pinned until the reader asks for the next; ``descriptor`` gives the pin's
  descriptor, so a warm copy costs one open per process that reads it.

The locks are POSIX ``flock``: keep the cache on a node-local filesystem.

Why one file of about 540 lines: the cache is one protocol over one directory. The lock, the
lease, the budget's eviction, the damaged copies kept aside and the streaming pins all act on the
same files under the same ``flock``, and its guarantees (no partial copy ever visible, one
download per node, a pinned copy never evicted) hold only across all of them; the rules above
are read together with the one ``ShardCache`` that keeps them.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

from ..base.errors import CommandError, DataFault, NoSpace, SourceUnavailable
from ..base.units import parse_size
from ..io import storage
from ..io.http_range import DEFAULT_RETRY, Retry, ShardChanged
from .reading import READ_BUFFER, open_range

ENV_BUDGET = "SHARD_CACHE_BUDGET"
log = logging.getLogger(__name__)


_CACHES: weakref.WeakSet = weakref.WeakSet()
os.register_at_fork(after_in_child=lambda: [cache._forget_pins() for cache in list(_CACHES)])


class CacheFull(CommandError, OSError):
    """The budget cannot hold what is asked (a command's one line, exit status 1)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CacheDiskFull(NoSpace, DataFault):
    """The disk under the cache has no room for a copy (no budget, or one larger than the disk): a
    fault of the run's data path, one line naming the copy, the bytes needed and free, and the remedy."""


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of the shard at ``url`` (its ``size`` and ``sha256`` from the
    manifest); ``end`` None: to the shard's end."""
    url: str
    sha256: str
    size: int
    start: int = 0
    end: int | None = None
    checked: bool = False  # its reader checks every sample against the manifest's per-sample digests

    @property
    def stop(self) -> int:
        return self.size if self.end is None else self.end

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.size

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    @property
    def name(self) -> str:
        return f"{self.sha256}.tar" if self.whole else f"{self.sha256}.{self.start}-{self.stop}.tar"

    @property
    def damaged_name(self) -> str | None:
        """The name its copy is kept aside under when its bytes are not the manifest's (None: never kept)."""
        return f"{self.sha256}.damaged.tar" if self.whole and self.checked else None


class _Lease(threading.Thread):
    """Every ``interval`` seconds until stopped, touches the download's lock file if the download
    moved since (``moved``) or is ``waiting`` on purpose."""

    def __init__(self, fd: int, interval: float):
        super().__init__(daemon=True, name="shard-cache-lease")
        self.fd, self.interval, self.stopped = fd, interval, threading.Event()
        self.progress, self.waits = 0, 0  # changed by the downloading thread alone

    def moved(self) -> None:
        self.progress += 1

    @contextlib.contextmanager
    def waiting(self):
        self.waits += 1
        try:
            yield
        finally:
            self.waits -= 1

    def run(self) -> None:
        seen = self.progress
        while not self.stopped.wait(self.interval):
            if self.progress != seen or self.waits:
                seen = self.progress
                os.utime(self.fd)

    def __enter__(self):
        os.utime(self.fd)
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.join()


class _Renewing:
    """A retry policy whose waits (backoff, a server's ``Retry-After``, a source that is down)
    renew the lease; all else is the policy's."""

    def __init__(self, policy: Retry, lease: _Lease):
        self._policy, self._lease = policy, lease

    def __getattr__(self, name: str):
        return getattr(self._policy, name)

    def wait(self, seconds: float) -> None:
        with self._lease.waiting():
            self._policy.wait(seconds)


class ShardCache:
    def __init__(self, directory: str, budget: int | str | None = None, *, heartbeat: float = 5.0,
                 lease: float = 120.0, poll: float = 0.05, retry: Retry = DEFAULT_RETRY):
        self.directory = directory
        self.budget = parse_size(budget if budget is not None else os.environ.get(ENV_BUDGET) or None)
        self.heartbeat, self.lease, self.poll, self.retry = heartbeat, lease, poll, retry
        self._pins: dict[str, list[int]] = {}  # file name -> [fd holding the shared lock, times pinned]
        self._pins_lock = threading.Lock()
        os.makedirs(directory, exist_ok=True)
        _CACHES.add(self)

    def _forget_pins(self) -> None:
        """In a forked child: the parent's pins stay the parent's (a copied descriptor would keep
        the copy pinned after the parent released it)."""
        for fd, _ in self._pins.values():
            os.close(fd)
        self._pins.clear()
        self._pins_lock = threading.Lock()  # another thread may have held it at the fork

    def path(self, piece: Piece | str) -> str:
        """Where the copy of a piece (or of the whole shard with this SHA-256) lives."""
        if isinstance(piece, str):
            piece = Piece("", piece, 0)
        return os.path.join(self.directory, piece.sha256[:2], piece.name)

    def places(self, piece: Piece) -> list[str]:
        """Where a copy its reader may take can be: its own name, then, for a ``checked`` whole shard,
        its damaged copy's (module docstring)."""
        dest = self.path(piece)
        aside = [os.path.join(os.path.dirname(dest), piece.damaged_name)] if piece.damaged_name else []
        return [dest] + aside

    def reserve(self, nbytes: int, what: str) -> None:
        """Refuse (``CacheFull``) when ``nbytes`` could never fit in the budget."""
        if self.budget is not None and nbytes > self.budget:
            raise CacheFull(f"{self.directory}: a cache budget of {self.budget:,} bytes cannot hold {what} "
                            f"({nbytes:,} bytes); raise ${ENV_BUDGET} or read without a cache")

    def _remedy(self) -> str:
        """What to do when the disk fills before the budget does."""
        if self.budget is None:
            return (f"the cache has no budget: give it one the disk can hold (${ENV_BUDGET}, e.g. 50GB) and "
                    "it evicts old copies, or free some space")
        return f"its budget of {self.budget:,} bytes is more than the disk holds: lower ${ENV_BUDGET}"

    def fetch(self, url: str, sha256: str, size: int, start: int = 0, end: int | None = None) -> str:
        """The local path of a verified copy of the shard at ``url`` (or of its bytes [start, end):
        the copy's byte 0 is the shard's byte ``start``), downloaded if needed and pinned (never
        evicted) until as many ``release`` calls as ``fetch`` calls."""
        return self.get(Piece(url, sha256, size, start, end))

    def get(self, piece: Piece) -> str:
        """``fetch`` of a ``Piece``: the path of its pinned copy (one of its ``places``)."""
        places = self.places(piece)
        dest = places[0]
        with self._pins_lock:
            held = self._held(places)
            if held is not None:
                self._pins[os.path.basename(held)][1] += 1
                return held
        asked = time.time()
        while True:
            pinned = next((p for p in places if self._pin(p)), None)
            if pinned is not None:
                return pinned
            lock = self._lock_download(places, piece.url)
            if lock is None:
                continue  # someone else's copy appeared
            try:
                with _Lease(lock, self.heartbeat) as lease:
                    if not any(map(os.path.exists, places)):
                        with storage.room_for(dest, piece.nbytes, error=CacheDiskFull, advice=self._remedy()):
                            # pinned by _download before it had its name
                            return self._download_or_give_up(piece, places, asked, lease)
            finally:
                os.unlink(dest + ".lock")  # still ours: we hold the lock on this very file
                os.close(lock)

    def descriptor(self, piece: Piece) -> int:
        """The read-only descriptor that pins a copy this object holds (read it with ``pread``; it
        stays open until the last ``release``)."""
        with self._pins_lock:
            return self._pins[os.path.basename(self._held(self.places(piece)))][0]

    def _held(self, places: list[str]) -> str | None:
        """Under ``_pins_lock``: the first of ``places`` this object pins."""
        return next((p for p in places if os.path.basename(p) in self._pins), None)

    def release(self, piece: Piece | str | None = None) -> None:
        """Unpin a copy (a ``Piece``, or a whole shard's SHA-256) once, or all this object pinned."""
        with self._pins_lock:
            if piece is None:
                for fd, _ in self._pins.values():
                    os.close(fd)
                self._pins.clear()
                return
            held = self._held(self.places(piece) if isinstance(piece, Piece) else [self.path(piece)])
            if held is None:
                return
            name = os.path.basename(held)
            self._pins[name][1] -= 1
            if not self._pins[name][1]:
                os.close(self._pins.pop(name)[0])

    def stream(self, pieces: Iterable[Piece], lookahead: int = 2) -> Iterator[str]:
        """The local path of each piece, in order, downloaded by a background thread up to
        ``lookahead`` pieces ahead; each is pinned until the next is asked for (or the iterator is
        closed)."""
        todo = iter(pieces)
        ahead: deque = deque()
        with ThreadPoolExecutor(1, thread_name_prefix="shard-cache") as downloader:
            def more():
                piece = next(todo, None)
                if piece is not None:
                    ahead.append((piece, downloader.submit(self.get, piece)))
            for _ in range(max(1, lookahead)):
                more()
            try:
                while ahead:
                    piece, copy = ahead[0]
                    path = copy.result()
                    ahead.popleft()
                    try:
                        yield path
                    finally:
                        self.release(piece)
                    more()
            finally:
                for piece, copy in ahead:
                    if copy.cancel():
                        continue
                    if copy.exception() is None:
                        self.release(piece)

    # --- pins and download locks --------------------------------------------------------------
    def _pin(self, dest: str) -> bool:
        try:
            fd = os.open(dest, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an eviction decides about this file
        if os.fstat(fd).st_nlink == 0:  # evicted just before we locked it
            os.close(fd)
            return False
        os.utime(fd)  # recency for LRU
        name = os.path.basename(dest)
        with self._pins_lock:
            if name in self._pins:  # pinned meanwhile by another thread of this process
                self._pins[name][1] += 1
                os.close(fd)
            else:
                self._pins[name] = [fd, 1]
        return True

    def _lock_download(self, places: list[str], url: str) -> int | None:
        """Hold the copy's download lock (returns its fd), or None once a copy is in one of its ``places``."""
        dest = places[0]
        lock_path = dest + ".lock"
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        while True:
            if any(map(os.path.exists, places)):
                return None
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    silent = time.time() - os.fstat(fd).st_mtime
                finally:
                    os.close(fd)
                if silent > self.lease:
                    raise TimeoutError(f"{url}: the process downloading this shard to "
                                       f"{os.path.dirname(dest)} has not renewed its lease for "
                                       f"{silent:.0f} s (lease {self.lease:g} s): "
                                       "no byte arrived and it was not waiting")
                time.sleep(self.poll)
                continue
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # we locked a lock file its finished owner had already removed: look again

    def _download_or_give_up(self, piece: Piece, places: list[str], asked: float, lease: _Lease) -> str:
        """``_download``, holding the copy's lock, unless the download that held it before gave up on
        its source after this process asked (``asked``, a ``time.time()``): then its reason is ours."""
        marker = places[0] + ".unavailable"
        try:
            if os.stat(marker).st_mtime >= asked:
                with open(marker, encoding="utf-8") as f:
                    raise SourceUnavailable(f.read().strip())
        except FileNotFoundError:
            pass
        try:
            path = self._download(piece, places, lease)
        except SourceUnavailable as gave_up:
            with open(marker + ".tmp", "w", encoding="utf-8") as f:
                f.write(str(gave_up))
            os.replace(marker + ".tmp", marker)
            raise
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker)
        return path

    def _download(self, piece: Piece, places: list[str], lease: _Lease) -> str:
        """Download, verify, pin and name a copy; its path (the damaged copy's for a ``checked`` whole
        shard whose bytes are not the manifest's)."""
        dest = places[0]
        for stale in glob.glob(glob.escape(dest) + ".tmp-*"):  # a dead downloader's; we hold the lock
            os.remove(stale)
        tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
        size = piece.nbytes
        with lease.waiting():
            self._make_room(size, tmp)
        h, n, began = hashlib.sha256(), 0, time.monotonic()
        try:
            with open(tmp, "r+b") as out, open_range(piece.url, piece.start, piece.stop, size=piece.size,
                                                     sha256=piece.sha256, retry=_Renewing(self.retry, lease),
                                                     checked=piece.checked) as src:
                while chunk := src.read(READ_BUFFER):
                    lease.moved()
                    h.update(chunk)
                    n += len(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())  # a copy under its final name must survive a crash whole
            if n != size:
                raise OSError(f"{piece.url}: staged copy of bytes {piece.start}-{piece.stop - 1} has {n} "
                              f"bytes; the manifest says {size}")
            if piece.whole and h.hexdigest() != piece.sha256:  # what another download would get too
                damaged = (f"{piece.url}: the copy downloaded has SHA-256 {h.hexdigest()}, the manifest "
                           f"says {piece.sha256}: the file changed or is damaged (shards verify names the "
                           "samples)")
                if not piece.checked:
                    raise ShardChanged(f"{damaged}; not kept")
                log.warning("%s; kept aside, its samples checked one by one against their digests", damaged)
                dest = places[1]
            # pinned before it is visible under its name: another process making room could
            # otherwise evict the new copy between its rename and our pin, and it would be fetched again
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                os.replace(tmp, dest)
            except BaseException:
                os.close(fd)
                raise
            name = os.path.basename(dest)
            with self._pins_lock:
                if name in self._pins:
                    self._pins[name][1] += 1
                    os.close(fd)
                else:
                    self._pins[name] = [fd, 1]
            log.info("%s: downloaded %s (%d bytes) in %.2f s", self.directory, piece.name, n,
                     time.monotonic() - began,
                     extra={"piece": piece.name, "nbytes": n})
            return dest
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    # --- budget ---------------------------------------------------------------------------------
    @contextlib.contextmanager
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

    def _make_room(self, size: int, tmp: str) -> None:
        """Create ``tmp`` at its full size once the budget has room for it, evicting unpinned
        copies oldest-used first, and waiting while other processes' pins hold the room."""
        self.reserve(size, "this shard")
        waiting = False
        while True:
            with self._directory_lock():
                if self._evict_for(size):
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                    try:
                        os.posix_fallocate(fd, 0, size)  # the budget counts it from now on
                    except OSError as e:
                        if e.errno in storage.FULL:  # the disk itself is full
                            os.close(fd)
                            os.remove(tmp)
                            raise
                        os.ftruncate(fd, size)  # a filesystem without fallocate
                    os.close(fd)
                    if waiting:
                        log.info("%s: room for %s bytes", self.directory, f"{size:,}")
                    return
            if not waiting:
                log.warning("%s: the %s-byte budget is held by shards in use or being downloaded; waiting "
                            "for room for %s more", self.directory, f"{self.budget:,}", f"{size:,}")
                waiting = True
            time.sleep(self.poll)

    def _evict_for(self, size: int) -> bool:
        """Under the directory lock: evict until ``size`` more bytes fit; False if pins hold the room."""
        if self.budget is None:
            return True
        copies, used = [], 0
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(".tar") or ".tar.tmp-" in e.name:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    used += st.st_size
                    if e.name.endswith(".tar"):
                        copies.append((st.st_mtime_ns, e.path, st.st_size))
        for _, path, nbytes in sorted(copies):
            if used + size <= self.budget:
                break
            if self._evict(path):
                used -= nbytes
        if used + size <= self.budget:
            return True
        with self._pins_lock:
            mine = sum(os.fstat(fd).st_size for fd, _ in self._pins.values())
        if mine + size > self.budget:
            raise CacheFull(f"{self.directory}: this process pins {mine:,} of the {self.budget:,}-byte "
                            f"budget; no room for {size:,} more")
        return False

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
