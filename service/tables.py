"""The file tables of served sets (``service.files.file_table``): each parsed once however many
requests ask for it at once (single flight), the most recently used ``limit`` kept (LRU), and a
changed local shard hashed again once however many requests find it changed.

A table is keyed by the set's id, its manifest's SHA-256 and the time of its last verification,
so a set rebuilt, re-registered or verified again gets a new table at its next request (the
record cache drops records at every commit to the catalog).
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from shards.catalog import Catalog, Record
from shards.reading import local_path

from .files import Entry, file_table, hash_local
from .stats import Counters

log = logging.getLogger("service.tables")


class FileTables:
    def __init__(self, catalog: Catalog, counters: Counters, limit: int = 64):
        self.catalog, self.counters, self.limit = catalog, counters, limit
        self.tables: OrderedDict[tuple, dict[str, Entry]] = OrderedDict()
        self.pending: dict[tuple, asyncio.Task] = {}  # loads (and re-hashes) under way

    async def table(self, rec: Record) -> dict[str, Entry]:
        key = (rec.id, rec.manifest_sha256, rec.verified)
        if key in self.tables:
            self.tables.move_to_end(key)
            return self.tables[key]
        return await self._once(key, self._load, key, rec)

    async def rehash(self, rec: Record, name: str) -> None:
        """Hash a changed local shard again and record it (its ETag from now on)."""
        await self._once(("rehash", rec.id, name), self._rehash, rec, name)

    async def _once(self, key: tuple, work, *args):
        """``work(*args)`` run once for every caller waiting on ``key`` at the same time."""
        task = self.pending.get(key)
        if task is None:
            task = self.pending[key] = asyncio.ensure_future(work(*args))
            task.add_done_callback(lambda _: self.pending.pop(key, None))
        self.counters.add("table_waiting")
        try:
            return await asyncio.shield(task)
        finally:
            self.counters.add("table_waiting", -1)

    async def _load(self, key: tuple, rec: Record) -> dict[str, Entry]:
        table = await asyncio.to_thread(file_table, rec.location, rec.files, rec.manifest_sha256, rec.verified_files)
        self.counters.add("manifest_parses")
        self.tables[key] = table
        while len(self.tables) > self.limit:
            self.tables.popitem(last=False)
        return table

    async def _rehash(self, rec: Record, name: str) -> None:
        size, mtime, sha = await asyncio.to_thread(hash_local, local_path(rec.location), name)
        entry = (await self.table(rec))[name]
        problem = None
        if (size, sha) != (entry.size, entry.sha256):
            problem = f"{name}: changed since it was last hashed, and its bytes are not the manifest's"
        log.warning("dataset %s: %s changed since it was last hashed; hashed again: %s", rec.id, name,
                    problem or "the same bytes")
        await asyncio.to_thread(self.catalog.record_file_verify, rec.id, name, [size, mtime, sha], problem)
        self.counters.add("reverified")
