"""Where a catalog lives: a SQLite file (the default, one host) or a PostgreSQL database (a
``postgresql://`` URL, shared by service replicas on many hosts). ``shards.catalog.store`` holds
all the SQL and runs it on either through the same small interface:

  * ``connect()``: a connection for one thread, whose ``execute(sql, params)`` takes ``?``
    placeholders and returns a cursor (``fetchone``, ``fetchall``, ``rowcount``) of rows read by
    index or column name;
  * ``transaction(db)``: one write transaction, and only one at a time over the whole catalog
    (SQLite's ``BEGIN IMMEDIATE``; on PostgreSQL a transaction-scoped advisory lock taken first),
    so a claim that reads and then writes decides exactly as it would alone, on both back ends;
  * ``version``/``set_version``: the schema version the migrations brought the catalog to (SQLite's
    ``PRAGMA user_version``; on PostgreSQL the one row of ``catalog_schema``);
  * ``ddl(sql)``: a migration statement in the back end's dialect (the migrations are written in
    SQLite's; PostgreSQL's ``REAL`` is single precision, so ``REAL`` columns become ``DOUBLE PRECISION``);
  * ``generation()``: a number that changes whenever anything commits to the catalog, from any
    process or host, for the caches of the service (``service.records``).

The PostgreSQL driver is psycopg 3 (``psycopg[binary]``), the maintained successor of psycopg2:
the catalog's API is synchronous (commands, Ray drivers, the server's worker threads), which
psycopg serves directly, where asyncpg would need an event loop in every caller; its binary wheel
carries libpq, and it speaks ``LISTEN``/``NOTIFY``, which ``generation`` is built on. A PostgreSQL
server that cannot be reached, or that drops the connection (a restart), is
``CatalogUnavailable`` naming it; the next call connects again.
"""
from __future__ import annotations

import functools
import os
import re
import sqlite3
import threading
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

from ..base.errors import CommandError

CHANNEL = "kf_catalog"  # PostgreSQL: every write transaction notifies it
WRITE_LOCK = 0x6B665F636174  # PostgreSQL: the advisory lock key every write transaction holds ("kf_cat")
_INHERITED: list = []  # connections a forked child found open: kept from being closed (see _PerThread)


class CatalogUnavailable(CommandError):
    """The catalog's database server cannot be reached or dropped the connection; the message names
    it. Transient: the service answers 503, a command ends with status 75 (try again later)."""
    status = 75


def is_url(location: str) -> bool:
    return location.startswith(("postgresql://", "postgres://"))


def open_backend(location: str, busy_timeout: float):
    return PostgreSQL(location) if is_url(location) else SQLite(location, busy_timeout)


def shown(location: str) -> str:
    """A catalog's location as messages print it: a URL without its password."""
    if not is_url(location):
        return location
    parts = urlsplit(location)
    if parts.password is None:
        return location
    netloc = parts.netloc.rsplit("@", 1)
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{netloc[1]}"))


class _PerThread:
    """One connection per thread and process: a forked child never uses (nor closes: closing would
    end the parent's session too) a connection it inherited."""

    def __init__(self, connect):
        self._connect, self._local = connect, threading.local()

    def get(self):
        held = getattr(self._local, "held", None)
        if held is not None and held[0] == os.getpid():
            return held[1]
        if held is not None:
            _INHERITED.append(held[1])
        db = self._connect()
        self._local.held = (os.getpid(), db)
        return db

    def drop(self) -> None:
        """Close this thread's connection (the next ``get`` opens another)."""
        held = getattr(self._local, "held", None)
        self._local.held = None
        if held is not None and held[0] == os.getpid():
            try:
                held[1].close()
            except Exception:  # noqa: BLE001 -- a broken connection may fail to close; it is dropped either way
                pass


# --- SQLite ---------------------------------------------------------------------------------------
class SQLite:
    """A catalog file, in WAL mode (readers never wait for the writer) with a busy timeout."""

    def __init__(self, path: str, busy_timeout: float):
        self.location, self.busy_timeout = path, busy_timeout
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.connections = _PerThread(self._open)
        self._watch = None  # generation(): a connection of its own that never writes

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.location, timeout=self.busy_timeout, isolation_level=None,
                             check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA foreign_keys = ON")
        return db

    def connect(self):
        return self.connections.get()

    @contextmanager
    def transaction(self, db):
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def version(self, db) -> int:
        return db.execute("PRAGMA user_version").fetchone()[0]

    def set_version(self, db, version: int) -> None:
        db.execute(f"PRAGMA user_version = {int(version)}")

    def ddl(self, sql: str) -> str:
        return sql

    def generation(self) -> int:
        """SQLite's ``data_version`` on a connection that never writes: it changes with every commit
        by any other connection, of this process or another. One thread only."""
        if self._watch is None or self._watch[0] != os.getpid():
            self._watch = (os.getpid(),
                           sqlite3.connect(self.location, isolation_level=None, check_same_thread=False))
        return self._watch[1].execute("PRAGMA data_version").fetchone()[0]

    def close(self) -> None:
        self.connections.drop()
        if self._watch is not None and self._watch[0] == os.getpid():
            self._watch[1].close()
        self._watch = None


# --- PostgreSQL -----------------------------------------------------------------------------------
class _Row(tuple):
    """A row read by index or by column name, as ``sqlite3.Row`` is."""
    names: tuple = ()

    def keys(self):
        return self.names

    def __getitem__(self, key):
        if isinstance(key, str):
            return tuple.__getitem__(self, self.names.index(key))
        return tuple.__getitem__(self, key)


@functools.lru_cache(maxsize=64)
def _row_class(names: tuple) -> type:
    return type("Row", (_Row,), {"names": names, "__slots__": ()})


def _rows(cursor):
    """psycopg's row factory: the cursor's rows as ``_Row``s."""
    return _row_class(tuple(c.name for c in cursor.description or ()))


@functools.lru_cache(maxsize=512)
def _placeholders(sql: str) -> str:
    """``?`` placeholders as psycopg's ``%s`` (no statement here holds a literal ``?`` or ``%``)."""
    return sql.replace("?", "%s")


class _PgConnection:
    """A thread's session with the server, under the catalog's ``?`` placeholders. A session found
    lost (the server restarted, a network cut) while nothing of ours was under way on it is opened
    again and the statement sent again; lost during a transaction, or not to be opened again, it is
    ``CatalogUnavailable`` (and opened again at the next statement)."""

    def __init__(self, backend: PostgreSQL):
        self.backend, self.conn = backend, backend.session()

    def execute(self, sql: str, params=()):
        import psycopg
        from psycopg.pq import TransactionStatus

        # a session lost while idle is opened again and the statement sent again, once
        for first in (True, False):
            if self.conn is None:
                self.conn = self.backend.session()
            idle = self.conn.info.transaction_status == TransactionStatus.IDLE
            try:
                return self.conn.execute(_placeholders(sql), tuple(params) or None)
            except psycopg.OperationalError as e:
                if not (self.conn.broken or self.conn.closed):
                    raise
                self.close()
                if not (first and idle):  # lost in a transaction (the server undid it), or lost again
                    raise self.backend.unavailable(e) from None

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # noqa: BLE001 -- a lost session may fail to close; it is dropped either way
                pass
        self.conn = None


class PostgreSQL:
    """A catalog in a PostgreSQL database, shared by any number of processes on any hosts."""

    def __init__(self, url: str, connect_timeout: int = 10):
        try:
            import psycopg  # noqa: F401 -- only a PostgreSQL catalog needs the driver
        except ImportError:
            raise CommandError(f"{shown(url)}: a PostgreSQL catalog needs psycopg 3 "
                               "(pip install 'psycopg[binary]')") from None
        self.location, self.connect_timeout = url, connect_timeout
        self.connections = _PerThread(self._open)
        self._listener: _Listener | None = None
        self._local_commits = 0

    def unavailable(self, e: Exception) -> CatalogUnavailable:
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        return CatalogUnavailable(f"the catalog {shown(self.location)} cannot be reached: {reason}")

    def session(self):
        """A new psycopg connection (autocommit: transactions are the catalog's own BEGIN/COMMIT)."""
        import psycopg

        try:
            return psycopg.connect(self.location, autocommit=True, connect_timeout=self.connect_timeout,
                                   row_factory=_rows)
        except psycopg.OperationalError as e:
            raise self.unavailable(e) from None

    def _open(self) -> _PgConnection:
        return _PgConnection(self)

    def connect(self) -> _PgConnection:
        return self.connections.get()

    @contextmanager
    def transaction(self, db: _PgConnection):
        db.execute("BEGIN")  # on a session found lost, a new one: nothing was under way
        try:
            db.execute("SELECT pg_advisory_xact_lock(?)", (WRITE_LOCK,))
            yield db
            db.execute(f"NOTIFY {CHANNEL}")  # delivered at commit, to every replica's listener
            db.execute("COMMIT")  # lost here, the outcome is unknown: CatalogUnavailable, not tried again
        except BaseException:
            if db.conn is not None:
                try:
                    db.conn.execute("ROLLBACK")
                except Exception:  # noqa: BLE001 -- the session is being given up on anyway
                    db.close()
            raise
        self._local_commits += 1  # this process's own commits count at once, before any notification

    def version(self, db) -> int:
        db.execute("CREATE TABLE IF NOT EXISTS catalog_schema (version INTEGER NOT NULL)")
        row = db.execute("SELECT version FROM catalog_schema").fetchone()
        return row[0] if row else 0

    def set_version(self, db, version: int) -> None:
        if db.execute("UPDATE catalog_schema SET version = ?", (version,)).rowcount == 0:
            db.execute("INSERT INTO catalog_schema (version) VALUES (?)", (version,))

    def ddl(self, sql: str) -> str:
        return re.sub(r"\bREAL\b", "DOUBLE PRECISION", sql)

    def generation(self) -> tuple[int, int]:
        """(notifications seen, this process's commits): changes with every commit to the catalog.
        Other processes' commits arrive as notifications on a connection of its own (a thread
        listening); this process's own count at once. While that connection is lost the last
        value stands, and it moves on when the connection is made again (commits made meanwhile
        were not seen)."""
        if self._listener is None or self._listener.pid != os.getpid():
            self._listener = _Listener(self)
        return self._listener.seen, self._local_commits

    def close(self) -> None:
        self.connections.drop()
        if self._listener is not None and self._listener.pid == os.getpid():
            self._listener.stop()
        self._listener = None


class _Listener(threading.Thread):
    """``LISTEN`` on the catalog's channel; ``seen`` counts notifications and reconnections."""

    RETRY_SECONDS = 0.5

    def __init__(self, backend: PostgreSQL):
        super().__init__(daemon=True, name="catalog-listener")
        self.backend, self.pid, self.seen = backend, os.getpid(), 0
        self.stopping, self.listening = threading.Event(), threading.Event()
        self.start()
        self.listening.wait(backend.connect_timeout)  # the first generation() counts from a live LISTEN

    def run(self) -> None:
        import psycopg

        while not self.stopping.is_set():
            try:
                with psycopg.connect(self.backend.location, autocommit=True,
                                     connect_timeout=self.backend.connect_timeout) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.seen += 1  # whatever committed while no one listened
                    self.listening.set()
                    while not self.stopping.is_set():
                        for _ in conn.notifies(timeout=1.0):
                            self.seen += 1
            except psycopg.Error:
                self.listening.set()  # the catalog is down: generation() must not wait for it
                self.stopping.wait(self.RETRY_SECONDS)

    def stop(self) -> None:
        self.stopping.set()
