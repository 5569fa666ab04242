"""Catalog lookups for the file-serving hot path, reused until the catalog changes.

A shard read would otherwise cost four SQL queries and a record's JSON decoding. Instead the
answer to each reference is kept and all of them are dropped as soon as anything commits to the
catalog file: SQLite's ``PRAGMA data_version``, read on a connection of this cache's own that
never writes, changes with every commit by any other connection, of this process or another
(a tag moved, a set removed or rebuilt, a build finished), so a request never sees a record older
than the last commit before it.
"""
from __future__ import annotations

import sqlite3

from shards.catalog import Catalog, Record


class RecordCache:
    """``Catalog.resolve`` answers, valid until the next commit to the catalog. One thread only."""

    def __init__(self, catalog: Catalog, limit: int = 1024):
        self.catalog, self.limit = catalog, limit
        self.db = sqlite3.connect(catalog.path, isolation_level=None, check_same_thread=False)
        self.version, self.records = None, {}

    def resolve(self, ref: str) -> Record | None:
        version = self.db.execute("PRAGMA data_version").fetchone()[0]
        if version != self.version or len(self.records) >= self.limit:
            self.version, self.records = version, {}
        if ref not in self.records:
            self.records[ref] = self.catalog.resolve(ref)
        return self.records[ref]

    def close(self) -> None:
        self.db.close()
