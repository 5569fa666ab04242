"""Catalog lookups for the file-serving hot path, reused until the catalog changes.

A shard read would otherwise cost four SQL queries and a record's JSON decoding. Instead the
answer to each reference is kept and all of them are dropped as soon as anything commits to the
catalog (``Catalog.generation``): on a SQLite file, SQLite's ``PRAGMA data_version``, which changes
with every commit by any other connection, of this process or another, so a request never sees a
record older than the last commit before it; on PostgreSQL, the notifications every write
transaction sends, which reach every replica within milliseconds of the commit (its own commits at
once), and a reconnection after the server was lost. That costs nothing per request, where asking
PostgreSQL for a generation number would cost a round trip (``bench/service.py --catalog-cost``).
While PostgreSQL is down the records already looked up are still answered: no commit can happen
meanwhile.
"""
from __future__ import annotations

from shards.catalog import Catalog, Record


class RecordCache:
    """``Catalog.resolve`` answers, valid until the next commit to the catalog. One thread only."""

    def __init__(self, catalog: Catalog, limit: int = 1024):
        self.catalog, self.limit = catalog, limit
        self.version, self.records = None, {}

    def resolve(self, ref: str) -> Record | None:
        version = self.catalog.generation()
        if version != self.version or len(self.records) >= self.limit:
            self.version, self.records = version, {}
        if ref not in self.records:
            self.records[ref] = self.catalog.resolve(ref)
        return self.records[ref]

    def close(self) -> None:
        self.catalog.close()
