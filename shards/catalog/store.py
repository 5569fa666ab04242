"""The dataset catalog: one SQLite file recording every shard set built, all its SQL here.

A record is keyed by the dataset id (see ``shards.catalog.ids``) and
moves through the states building -> ready | failed, and to deleted when forgotten. The
process building a set holds a lease on its record: an owner (host, pid, random token) and a
heartbeat it refreshes. A lease is dead when the heartbeat is older than the lease time, or
at once when the owner ran on this host and its pid is gone; a dead lease is marked failed
and may be claimed again. ``claim`` decides, in one write transaction, whether a caller
builds, reuses a ready set, or waits for a live builder: two claims of one id never both win.

The file is opened in WAL mode (readers never block on the writer) with a busy timeout, and
every write runs under ``BEGIN IMMEDIATE``. Missing schema migrations are applied at open in
one transaction; a file from a newer version of this code is refused. Keep the file on a
local filesystem: SQLite's WAL needs shared memory, which network filesystems do not give.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import CommandError
from .schema import MIGRATIONS

ENV_VAR = "SHARD_SERVICE_CATALOG"
STATES = ("building", "ready", "failed", "deleted")
LEASE_SECONDS = 60.0  # a builder that has not heartbeaten for this long is presumed dead
HEARTBEAT_SECONDS = 10.0
_JSON_COLUMNS = ("options", "splits", "files", "progress", "owner", "verified_files")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # names and tags: plain URL path segments


class CatalogError(CommandError):
    """A catalog operation that cannot be done as asked (the message says why; a command prints
    it as its one line)."""


def default_path() -> str:
    """``$SHARD_SERVICE_CATALOG``, else the per-user cache directory's ``kinetics-fast/catalog.sqlite``."""
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "kinetics-fast", "catalog.sqlite")


def check_name(text: str, what: str = "name") -> str:
    if not NAME.fullmatch(text) or ".." in text:
        raise CatalogError(f"{what} {text!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
                           "letter or digit")
    return text


def new_owner() -> dict:
    """The identity of one build attempt in this process."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Record:
    id: str
    name: str | None
    source: str
    location: str
    options: dict
    state: str
    created: float
    splits: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)
    manifest_sha256: str | None = None
    builder_version: str | None = None
    finished: float | None = None
    owner: dict | None = None
    heartbeat: float | None = None
    attempts: int = 0
    progress: dict = field(default_factory=dict)
    error: str | None = None
    verified: float | None = None
    verify_problems: int | None = None
    verify_detail: str | None = None
    verified_files: dict = field(default_factory=dict)  # {file: [size, mtime_ns, sha256]} as last hashed
    replaced_by: str | None = None  # the set forced into its location ('': one built without a catalog)
    replaced: float | None = None  # when
    tags: list[str] = field(default_factory=list)

    def lease_alive(self, now: float | None = None, lease: float = LEASE_SECONDS) -> bool:
        """Whether the process building this record still counts as alive."""
        if self.state != "building" or not self.owner:
            return False
        if self.owner.get("host") == socket.gethostname() and not _pid_alive(int(self.owner["pid"])):
            return False
        return (now or time.time()) - (self.heartbeat or 0) < lease

    def to_json(self) -> dict:
        """The record as the API and ``show --json`` print it (times in ISO 8601 UTC)."""
        iso = lambda t: None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))  # noqa: E731
        return {"id": self.id, "name": self.name, "tags": self.tags, "state": self.state,
                "source": self.source, "location": self.location, "options": self.options,
                "splits": self.splits, "manifest_sha256": self.manifest_sha256,
                "builder_version": self.builder_version, "created": iso(self.created),
                "finished": iso(self.finished), "attempts": self.attempts, "progress": self.progress,
                "error": self.error,
                "verified": None if self.verified is None else
                {"at": iso(self.verified), "problems": self.verify_problems, "detail": self.verify_detail},
                "replaced": None if self.replaced is None else {"at": iso(self.replaced), "by": self.replaced_by}}


@dataclass
class Claim:
    """What ``Catalog.claim`` decided: ``build`` (the caller now owns the record), ``reuse``
    (a ready set exists) or ``wait`` (another live process is building it)."""
    action: str
    record: Record
    owner: dict | None = None


class Catalog:
    """A catalog file; safe to share between threads (one connection each) and processes."""

    def __init__(self, path: str | None = None, busy_timeout: float = 30.0, migrations=MIGRATIONS):
        self.path = path or default_path()
        self.busy_timeout = busy_timeout
        self._local = threading.local()
        if os.path.dirname(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._migrate(migrations)

    # --- connection and transactions ---------------------------------------------------------
    @property
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute("PRAGMA foreign_keys = ON")
            self._local.db = db
        return db

    @contextmanager
    def _write(self):
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _migrate(self, migrations) -> None:
        with self._write() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > len(migrations):
                raise CatalogError(f"{self.path}: catalog schema version {version} is newer than this "
                                   f"program's {len(migrations)}; upgrade kinetics-fast to use it")
            for statements in migrations[version:]:
                for sql in statements:
                    db.execute(sql)
            db.execute(f"PRAGMA user_version = {len(migrations)}")

    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    # --- reading -----------------------------------------------------------------------------
    def _records(self, where: str, params=()) -> list[Record]:
        db = self._db
        rows = db.execute(f"SELECT * FROM datasets WHERE {where} ORDER BY created, id", params).fetchall()
        out = []
        for row in rows:
            d = dict(row)
            for col in _JSON_COLUMNS:
                d[col] = json.loads(d[col]) if d[col] else ({} if col != "owner" else None)
            tags = db.execute("SELECT tag FROM tags WHERE dataset_id = ? ORDER BY tag", (d["id"],)).fetchall()
            out.append(Record(**d, tags=[t[0] for t in tags]))
        return out

    def get(self, dataset_id: str) -> Record | None:
        found = self._records("id = ?", (dataset_id,))
        return found[0] if found else None

    def list(self, states=("building", "ready", "failed")) -> list[Record]:
        return self._records(f"state IN ({','.join('?' * len(states))})", tuple(states))

    def resolve(self, ref: str) -> Record | None:
        """A live (not deleted) record by exact id, name, tag, or unique id prefix of 6+ characters."""
        db = self._db
        row = (db.execute("SELECT id FROM datasets WHERE id = ? AND state != 'deleted'", (ref,)).fetchone()
               or db.execute("SELECT id FROM datasets WHERE name = ? AND state != 'deleted'", (ref,)).fetchone()
               or db.execute("SELECT dataset_id FROM tags WHERE tag = ?", (ref,)).fetchone())
        if row is None and len(ref) >= 6 and all(c in "0123456789abcdef" for c in ref):
            rows = db.execute("SELECT id FROM datasets WHERE id >= ? AND id < ? AND state != 'deleted' LIMIT 2",
                              (ref, ref + "g")).fetchall()
            row = rows[0] if len(rows) == 1 else None
        return self.get(row[0]) if row else None

    def replaced(self, ref: str) -> Record | None:
        """The set last replaced (``Catalog.claim``'s ``force``) among those ``ref`` named, by id,
        unique id prefix of 6+ characters or name; None if none was."""
        rows = self._records("state = 'deleted' AND replaced IS NOT NULL AND (id = ? OR name = ? OR "
                             "(length(?) >= 6 AND substr(id, 1, length(?)) = ?))", (ref, ref, ref, ref, ref))
        return max(rows, key=lambda r: r.replaced) if rows else None

    # --- building ----------------------------------------------------------------------------
    def claim(self, dataset_id: str, *, source: str, location: str, options: dict, name: str | None = None,
              strict_name: bool = False, force: bool = False, owner: dict | None = None) -> Claim:
        """Decide, atomically, who builds ``dataset_id`` (see ``Claim``).

        A ready set is reused unless ``force``; a building one is waited for while its lease is
        alive, else marked failed and taken over; a failed one is built again where it was
        (its finished work is resumed) unless ``force``. ``name`` taken by another set: an
        error when ``strict_name``, else the id's first 8 characters are appended. Another set
        at ``location``: an error, unless ``force``, which marks it replaced by this one (never a
        tagged set, nor one being built).
        """
        owner = owner or new_owner()
        now = time.time()
        with self._write() as db:
            rec = self.get(dataset_id)
            if rec and rec.state == "ready" and not force:
                return Claim("reuse", rec)
            if rec and rec.state == "building":
                if rec.lease_alive(now):
                    return Claim("wait", rec)
                self._mark_dead(db, rec, now)
                rec.state = "failed"
            if rec and rec.state == "failed" and not force:
                location = rec.location  # resume where the failed attempt left its work
            for other in self._records("location = ? AND id != ? AND state != 'deleted'", (location, dataset_id)):
                self._replace(db, other, dataset_id, force, now)
            if rec and rec.name and (name is None or not strict_name):
                name = rec.name  # a set keeps its name unless given another explicitly
            if name is not None:
                check_name(name)
            if name is not None and db.execute("SELECT 1 FROM datasets WHERE name = ? AND id != ? AND state != "
                                               "'deleted'", (name, dataset_id)).fetchone():
                if strict_name:
                    raise CatalogError(f"the name {name!r} belongs to another dataset")
                name = f"{name}-{dataset_id[:8]}"
            values = {"name": name, "source": source, "location": location, "options": json.dumps(options),
                      "state": "building", "owner": json.dumps(owner), "heartbeat": now, "progress": "{}",
                      "error": None, "finished": None, "replaced_by": None, "replaced": None}
            if rec:
                db.execute(f"UPDATE datasets SET {', '.join(f'{k} = ?' for k in values)}, attempts = attempts + 1 "
                           "WHERE id = ?", (*values.values(), dataset_id))
            else:
                db.execute(f"INSERT INTO datasets (id, created, attempts, {', '.join(values)}) "
                           f"VALUES (?, ?, 1, {', '.join('?' * len(values))})", (dataset_id, now, *values.values()))
        return Claim("build", self.get(dataset_id), owner)

    def _replace(self, db, rec: Record, by: str, force: bool, now: float) -> None:
        """Mark ``rec`` replaced by ``by`` (an id, or '' for a build without a catalog) as another
        build is about to be written into its location; refused without ``force``, and always for a
        tagged set or one a live process is building."""
        what = f"dataset {rec.id}{' (' + rec.name + ')' if rec.name else ''}"
        if rec.lease_alive(now):
            raise CatalogError(f"{rec.location} already holds {what}, which is being built; build into another location")
        if not force:
            raise CatalogError(f"{rec.location} already holds {what}; --force replaces it (the catalog records it "
                               "as replaced), or build into another location")
        if rec.tags:
            raise CatalogError(f"{rec.location} already holds {what}, tagged {', '.join(rec.tags)}: a tagged set is never "
                               f"replaced; untag it first (shard-service untag {rec.tags[0]}) or build into another "
                               "location")
        db.execute("UPDATE datasets SET state = 'deleted', replaced_by = ?, replaced = ?, owner = NULL, heartbeat = "
                   "NULL WHERE id = ?", (by, now, rec.id))

    def replace_at(self, location: str, force: bool) -> list[Record]:
        """Before a build without a catalog record of its own replaces the set at ``location``: mark
        every live set recorded there replaced (``_replace``: refused without ``force``); returns them."""
        now = time.time()
        with self._write() as db:
            found = self._records("location = ? AND state != 'deleted'", (location,))
            for rec in found:
                self._replace(db, rec, "", force, now)
        return found

    def at_location(self, location: str) -> list[Record]:
        """The live sets recorded at ``location``."""
        return self._records("location = ? AND state != 'deleted'", (location,))

    def _owned_update(self, dataset_id: str, owner: dict, sets: str, params=()) -> bool:
        """Update a building record only while ``owner`` still holds its lease."""
        with self._write() as db:
            cur = db.execute(f"UPDATE datasets SET {sets} WHERE id = ? AND state = 'building' AND owner = ?",
                             (*params, dataset_id, json.dumps(owner)))
            return cur.rowcount == 1

    def heartbeat(self, dataset_id: str, owner: dict) -> bool:
        """Refresh the lease; False when another process has taken the record over."""
        return self._owned_update(dataset_id, owner, "heartbeat = ?", (time.time(),))

    def set_progress(self, dataset_id: str, owner: dict, progress: dict) -> bool:
        return self._owned_update(dataset_id, owner, "progress = ?, heartbeat = ?",
                                  (json.dumps(progress, sort_keys=True), time.time()))

    def finish(self, dataset_id: str, owner: dict, *, splits: dict, files: dict, manifest_sha256: str,
               builder_version: str, progress: dict | None = None, verified_files: dict | None = None) -> bool:
        """Mark the set ready; ``verified_files``: its shards as the builder hashed them (``shards.verify.stamps``)."""
        return self._owned_update(
            dataset_id, owner, "state = 'ready', splits = ?, files = ?, manifest_sha256 = ?, builder_version = ?, "
            "finished = ?, owner = NULL, heartbeat = NULL, progress = COALESCE(?, progress), verified_files = ?",
            (json.dumps(splits, sort_keys=True), json.dumps(files, sort_keys=True), manifest_sha256,
             builder_version, time.time(), None if progress is None else json.dumps(progress, sort_keys=True),
             json.dumps(verified_files or {}, sort_keys=True)))

    def fail(self, dataset_id: str, owner: dict, error: str) -> bool:
        return self._owned_update(dataset_id, owner, "state = 'failed', error = ?, finished = ?, owner = NULL, "
                                  "heartbeat = NULL", (error, time.time()))

    def _mark_dead(self, db, rec: Record, now: float) -> None:
        who = f"{rec.owner.get('host')} pid {rec.owner.get('pid')}" if rec.owner else "unknown"
        db.execute("UPDATE datasets SET state = 'failed', owner = NULL, heartbeat = NULL, finished = ?, "
                   "error = ? WHERE id = ? AND state = 'building'",
                   (now, f"abandoned: the builder ({who}) died or stopped heartbeating", rec.id))

    def reap(self, lease: float = LEASE_SECONDS) -> list[str]:
        """Mark failed every building record whose lease is dead; return their ids."""
        now, dead = time.time(), []
        with self._write() as db:
            for rec in self._records("state = 'building'"):
                if not rec.lease_alive(now, lease):
                    self._mark_dead(db, rec, now)
                    dead.append(rec.id)
        return dead

    # --- tags, removal, verification ---------------------------------------------------------
    def tag(self, dataset_id: str, tag: str) -> str | None:
        """Point ``tag`` at the dataset; returns the id it pointed at before, if another."""
        check_name(tag, "tag")
        with self._write() as db:
            if not db.execute("SELECT 1 FROM datasets WHERE id = ? AND state != 'deleted'", (dataset_id,)).fetchone():
                raise CatalogError(f"no dataset {dataset_id}")
            prev = db.execute("SELECT dataset_id FROM tags WHERE tag = ?", (tag,)).fetchone()
            db.execute("INSERT INTO tags (tag, dataset_id) VALUES (?, ?) "
                       "ON CONFLICT(tag) DO UPDATE SET dataset_id = excluded.dataset_id", (tag, dataset_id))
        return prev[0] if prev and prev[0] != dataset_id else None

    def untag(self, tag: str, dataset_id: str | None = None) -> bool:
        """Remove ``tag``; with ``dataset_id``, only while the tag is on that set (one statement, so a
        tag another writer has just moved to another set stays). False if nothing was removed."""
        with self._write() as db:
            if dataset_id is None:
                return db.execute("DELETE FROM tags WHERE tag = ?", (tag,)).rowcount == 1
            return db.execute("DELETE FROM tags WHERE tag = ? AND dataset_id = ?", (tag, dataset_id)).rowcount == 1

    def mark_deleted(self, dataset_id: str) -> None:
        """Forget a set (the row stays, as history, in state deleted). Refused while it is tagged
        or being built by a live process."""
        with self._write() as db:
            rec = self.get(dataset_id)
            if rec is None or rec.state == "deleted":
                raise CatalogError(f"no dataset {dataset_id}")
            if rec.tags:
                raise CatalogError(f"dataset {dataset_id} is tagged {', '.join(rec.tags)}; untag it first")
            if rec.lease_alive():
                raise CatalogError(f"dataset {dataset_id} is being built")
            db.execute("UPDATE datasets SET state = 'deleted', owner = NULL, heartbeat = NULL WHERE id = ?",
                       (dataset_id,))

    def record_verify(self, dataset_id: str, problems: int, detail: str, files: dict | None = None) -> None:
        """A whole set's verification; ``files``: {shard: [size, mtime_ns, sha256]} of what it hashed."""
        with self._write() as db:
            db.execute("UPDATE datasets SET verified = ?, verify_problems = ?, verify_detail = ?, "
                       "verified_files = ? WHERE id = ?",
                       (time.time(), problems, detail, json.dumps(files or {}, sort_keys=True), dataset_id))

    def record_file_verify(self, dataset_id: str, name: str, stamp: list, problem: str | None) -> None:
        """One shard hashed again (by the server, having found its file changed): its new stamp,
        and a problem added to the set's last verification if its bytes are not the manifest's."""
        with self._write() as db:
            row = db.execute("SELECT verified_files, verify_problems, verify_detail FROM datasets WHERE id = ?",
                             (dataset_id,)).fetchone()
            files = {**json.loads(row["verified_files"] or "{}"), name: stamp}
            problems, detail = row["verify_problems"] or 0, row["verify_detail"]
            if problem:
                problems, detail = problems + 1, problem if detail in (None, "ok") else f"{detail}; {problem}"
            db.execute("UPDATE datasets SET verified = ?, verify_problems = ?, verify_detail = ?, "
                       "verified_files = ? WHERE id = ?",
                       (time.time(), problems, detail, json.dumps(files, sort_keys=True), dataset_id))
