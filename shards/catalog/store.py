"""The dataset catalog: every shard set built, with leases and migrations, all its SQL here.

A record is keyed by the dataset id (see ``shards.catalog.ids``) and
moves through the states building -> ready | failed, and to deleted when forgotten. The
process building a set holds a lease on its record: an owner (host, pid, random token) and a
heartbeat it refreshes. A lease is dead when the heartbeat is older than the lease time, or
at once when the owner ran on this host and its pid is gone; a dead lease is marked failed
and may be claimed again. ``claim`` decides, in one write transaction, whether a caller
builds, reuses a ready set, or waits for a live builder: two claims of one id never both win.

The catalog is a SQLite file (the default) or a PostgreSQL database (``postgresql://`` URL):
the same SQL on both, through ``shards.catalog.backends``. Write transactions run one at a time
over the whole catalog on either (SQLite's ``BEGIN IMMEDIATE``, PostgreSQL's advisory lock);
readers never wait for them (SQLite's WAL, PostgreSQL's snapshots). Missing schema migrations are
applied at open in one transaction; a catalog from a newer version of this code is refused. Keep
a SQLite file on a local filesystem: its WAL needs shared memory, which network filesystems do
not give; replicas on several hosts share a PostgreSQL catalog instead.

Why one file of about 440 lines: all of the catalog's SQL is here, beside the records it fills,
so a column's reads and writes have one place (docs/architecture.md); the back ends, the schema
and the ids are the package's other modules.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..base.errors import CommandError
from .backends import CatalogUnavailable, open_backend, shown
from .schema import MIGRATIONS

ENV_VAR = "SHARD_SERVICE_CATALOG"
STATES = ("building", "ready", "failed", "deleted")
LEASE_SECONDS = 60.0  # a builder that has not heartbeaten for this long is presumed dead
HEARTBEAT_SECONDS = 10.0
_JSON_COLUMNS = ("options", "splits", "files", "progress", "owner", "verified_files", "request")
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
    request: dict | None = None  # a build asked for over HTTP: its request, which a replica can run again
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
                "replaced": None if self.replaced is None else
                {"at": iso(self.replaced), "by": self.replaced_by}}


@dataclass
class Claim:
    """What ``Catalog.claim`` decided: ``build`` (the caller now owns the record), ``reuse``
    (a ready set exists) or ``wait`` (another live process is building it)."""
    action: str
    record: Record
    owner: dict | None = None


class Catalog:
    """A catalog (a SQLite file, or a PostgreSQL database named by a ``postgresql://`` URL: see
    ``shards.catalog.backends``); safe to share between threads (one connection each) and processes."""

    def __init__(self, path: str | None = None, busy_timeout: float = 30.0, migrations=MIGRATIONS):
        self.path = path or default_path()  # the file, or the URL
        self.backend = open_backend(self.path, busy_timeout)
        self._migrate(migrations)

    @property
    def where(self) -> str:
        """The catalog as messages name it (a URL without its password)."""
        return shown(self.path)

    # --- connection and transactions ---------------------------------------------------------
    @property
    def _db(self):
        return self.backend.connect()

    @contextmanager
    def _write(self):
        with self.backend.transaction(self._db) as db:
            yield db

    def _migrate(self, migrations) -> None:
        with self._write() as db:
            version = self.backend.version(db)
            if version > len(migrations):
                raise CatalogError(f"{self.where}: catalog schema version {version} is newer than this "
                                   f"program's {len(migrations)}; upgrade kinetics-fast to use it")
            for number, statements in enumerate(migrations[version:], version + 1):
                for sql in statements:
                    try:
                        db.execute(self.backend.ddl(sql))
                    except CatalogUnavailable:
                        raise
                    except Exception as e:  # noqa: BLE001 -- either driver's error: the whole migration is undone
                        raise CatalogError(f"{self.where}: schema migration {number} failed "
                                           f"({' '.join(str(e).split())}); the catalog stays at version "
                                           f"{version}") from None
            self.backend.set_version(db, len(migrations))

    def schema_version(self) -> int:
        return self.backend.version(self._db)

    def generation(self):
        """A value that changes whenever anything commits to the catalog (``service.records``)."""
        return self.backend.generation()

    def close(self) -> None:
        self.backend.close()

    # --- reading -----------------------------------------------------------------------------
    def _records(self, where: str, params=()) -> list[Record]:
        db = self._db
        rows = db.execute(f"SELECT * FROM datasets WHERE {where} ORDER BY created, id", params).fetchall()
        out = []
        for row in rows:
            d = dict(row)
            for col in _JSON_COLUMNS:
                d[col] = json.loads(d[col]) if d[col] else ({} if col not in ("owner", "request") else None)
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
               or db.execute("SELECT id FROM datasets WHERE name = ? AND state != 'deleted'",
                             (ref,)).fetchone()
               or db.execute("SELECT dataset_id FROM tags WHERE tag = ?", (ref,)).fetchone())
        if row is None and len(ref) >= 6 and all(c in "0123456789abcdef" for c in ref):
            rows = db.execute("SELECT id FROM datasets WHERE substr(id, 1, ?) = ? AND state != 'deleted' "
                              "LIMIT 2", (len(ref), ref)).fetchall()
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
              strict_name: bool = False, force: bool = False, owner: dict | None = None,
              request: dict | None = None) -> Claim:
        """Decide, atomically, who builds ``dataset_id`` (see ``Claim``).

        A ready set is reused unless ``force``; a building one is waited for while its lease is
        alive, else marked failed and taken over; a failed one is built again where it was
        (its finished work is resumed) unless ``force``. ``name`` taken by another set: an
        error when ``strict_name``, else the id's first 8 characters are appended. Another set
        at ``location``: an error, unless ``force``, which marks it replaced by this one (never a
        tagged set, nor one being built). ``request``: a build asked for over HTTP, kept for a
        replica to take it over (``orphans``).
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
            for other in self._records("location = ? AND id != ? AND state != 'deleted'",
                                       (location, dataset_id)):
                self._replace(db, other, dataset_id, force, now)
            if rec and rec.name and (name is None or not strict_name):
                name = rec.name  # a set keeps its name unless given another explicitly
            if name is not None:
                check_name(name)
            if name is not None and db.execute("SELECT 1 FROM datasets WHERE name = ? AND id != ? "
                                               "AND state != 'deleted'", (name, dataset_id)).fetchone():
                if strict_name:
                    raise CatalogError(f"the name {name!r} belongs to another dataset")
                name = f"{name}-{dataset_id[:8]}"
            values = {"name": name, "source": source, "location": location, "options": json.dumps(options),
                      "state": "building", "owner": json.dumps(owner), "heartbeat": now, "progress": "{}",
                      "error": None, "finished": None, "replaced_by": None, "replaced": None,
                      "request": None if request is None else json.dumps(request, sort_keys=True)}
            if rec:
                db.execute(f"UPDATE datasets SET {', '.join(f'{k} = ?' for k in values)}, "
                           "attempts = attempts + 1 WHERE id = ?", (*values.values(), dataset_id))
            else:
                db.execute(f"INSERT INTO datasets (id, created, attempts, {', '.join(values)}) "
                           f"VALUES (?, ?, 1, {', '.join('?' * len(values))})",
                           (dataset_id, now, *values.values()))
        return Claim("build", self.get(dataset_id), owner)

    def _replace(self, db, rec: Record, by: str, force: bool, now: float) -> None:
        """Mark ``rec`` replaced by ``by`` (an id, or '' for a build without a catalog) as another
        build is about to be written into its location; refused without ``force``, and always for a
        tagged set or one a live process is building."""
        what = f"dataset {rec.id}{' (' + rec.name + ')' if rec.name else ''}"
        if rec.lease_alive(now):
            raise CatalogError(f"{rec.location} already holds {what}, which is being built; "
                               "build into another location")
        if not force:
            raise CatalogError(f"{rec.location} already holds {what}; --force replaces it (the catalog "
                               "records it as replaced), or build into another location")
        if rec.tags:
            raise CatalogError(f"{rec.location} already holds {what}, tagged {', '.join(rec.tags)}: a tagged "
                               f"set is never replaced; untag it first (shard-service untag {rec.tags[0]}) "
                               "or build into another location")
        db.execute("UPDATE datasets SET state = 'deleted', replaced_by = ?, replaced = ?, owner = NULL, "
                   "heartbeat = NULL WHERE id = ?", (by, now, rec.id))

    def replace_at(self, location: str, force: bool) -> list[Record]:
        """Before a build without a catalog record of its own replaces the set at ``location``: mark
        every live set recorded there replaced (``_replace``: refused without ``force``); returns them."""
        now = time.time()
        with self._write() as db:
            found = self._records("location = ? AND state != 'deleted'", (location,))
            for rec in found:
                self._replace(db, rec, "", force, now)
        return found

    def _owned_update(self, dataset_id: str, owner: dict, sets: str, params=()) -> bool:
        """Update a building record only while ``owner`` still holds its lease."""
        with self._write() as db:
            cur = db.execute(f"UPDATE datasets SET {sets} WHERE id = ? AND state = 'building' AND owner = ?",
                             (*params, dataset_id, json.dumps(owner)))
            return cur.rowcount == 1

    def transfer(self, dataset_id: str, owner: dict, to: dict) -> bool:
        """Hand a building record's lease from ``owner`` to ``to`` (a server to the build process it
        started, whose death then ends the lease); False if ``owner`` no longer holds it."""
        return self._owned_update(dataset_id, owner, "owner = ?, heartbeat = ?",
                                  (json.dumps(to), time.time()))

    def orphans(self) -> list[Record]:
        """Builds asked for over HTTP whose builder is gone (a dead lease): a replica may take them
        over (``claim`` with their request decides which one does)."""
        return [rec for rec in self._records("state = 'building' AND request IS NOT NULL")
                if not rec.lease_alive()]

    def heartbeat(self, dataset_id: str, owner: dict) -> bool:
        """Refresh the lease; False when another process has taken the record over."""
        return self._owned_update(dataset_id, owner, "heartbeat = ?", (time.time(),))

    def set_progress(self, dataset_id: str, owner: dict, progress: dict) -> bool:
        return self._owned_update(dataset_id, owner, "progress = ?, heartbeat = ?",
                                  (json.dumps(progress, sort_keys=True), time.time()))

    def finish(self, dataset_id: str, owner: dict, *, splits: dict, files: dict, manifest_sha256: str,
               builder_version: str, progress: dict | None = None,
               verified_files: dict | None = None) -> bool:
        """Mark the set ready; ``verified_files``: its shards as the builder hashed them
        (``shards.tools.verify.stamps``)."""
        return self._owned_update(
            dataset_id, owner, "state = 'ready', splits = ?, files = ?, manifest_sha256 = ?, "
            "builder_version = ?, finished = ?, owner = NULL, heartbeat = NULL, "
            "progress = COALESCE(?, progress), verified_files = ?",
            (json.dumps(splits, sort_keys=True), json.dumps(files, sort_keys=True), manifest_sha256,
             builder_version, time.time(), None if progress is None else json.dumps(progress, sort_keys=True),
             json.dumps(verified_files or {}, sort_keys=True)))

    def fail(self, dataset_id: str, owner: dict, error: str) -> bool:
        return self._owned_update(dataset_id, owner, "state = 'failed', error = ?, finished = ?, "
                                  "owner = NULL, heartbeat = NULL", (error, time.time()))

    def _mark_dead(self, db, rec: Record, now: float, reason: str | None = None) -> None:
        who = f"{rec.owner.get('host')} pid {rec.owner.get('pid')}" if rec.owner else "unknown"
        db.execute("UPDATE datasets SET state = 'failed', owner = NULL, heartbeat = NULL, finished = ?, "
                   "error = ? WHERE id = ? AND state = 'building'",
                   (now, reason or f"abandoned: the builder ({who}) died or stopped heartbeating", rec.id))

    def fail_orphan(self, dataset_id: str, reason: str) -> bool:
        """Record failed, with ``reason``, a build whose builder is gone (still building, its lease dead)."""
        with self._write() as db:
            rec = self.get(dataset_id)
            if rec is None or rec.state != "building" or rec.lease_alive():
                return False
            self._mark_dead(db, rec, time.time(), reason)
        return True

    def reap(self, lease: float = LEASE_SECONDS) -> list[str]:
        """Mark failed every building record whose lease is dead; return their ids. Writes (and so
        makes every server's caches drop their answers) only when there is one."""
        now, dead = time.time(), []
        if all(rec.lease_alive(now, lease) for rec in self._records("state = 'building'")):
            return dead
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
            if not db.execute("SELECT 1 FROM datasets WHERE id = ? AND state != 'deleted'",
                              (dataset_id,)).fetchone():
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
            return db.execute("DELETE FROM tags WHERE tag = ? AND dataset_id = ?",
                              (tag, dataset_id)).rowcount == 1

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
            row = db.execute("SELECT verified_files, verify_problems, verify_detail FROM datasets "
                             "WHERE id = ?", (dataset_id,)).fetchone()
            files = {**json.loads(row["verified_files"] or "{}"), name: stamp}
            problems, detail = row["verify_problems"] or 0, row["verify_detail"]
            if problem:
                problems, detail = problems + 1, problem if detail in (None, "ok") else f"{detail}; {problem}"
            db.execute("UPDATE datasets SET verified = ?, verify_problems = ?, verify_detail = ?, "
                       "verified_files = ? WHERE id = ?",
                       (time.time(), problems, detail, json.dumps(files, sort_keys=True), dataset_id))
