"""The file tables of served sets (``service.files.file_table``): each parsed once however many
requests ask for it at once (single flight), the most recently used ``limit`` kept (LRU), and a
changed local file hashed again once however many requests find it changed.

A table is keyed by the set's id, its manifest's SHA-256 and the time of its last verification,
so a set rebuilt, re-registered or verified again gets a new table at its next request (the
record cache looks a record up again after every commit to the catalog). A commit drops no table:
through a catalog outage a known set's table serves on with its last known record
(``service.records``).

A file found changed is first a question about the whole set: is its manifest still the one
registered (``shards.catalog.condition``)? If not, the set was rebuilt or edited in place and the
request is refused (409, the set ``changed``); only if it is, is the file hashed again. The sets'
conditions, which ``GET /v1/datasets`` shows, are kept by their records and their manifests'
stamps, so a changed set's manifest is read once, not at every request or listing.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from shards.catalog import Catalog, Record
from shards.catalog.condition import Condition, condition, file_stamp
from shards.format.manifest import MANIFEST_NAME
from shards.io import storage
from shards.read.reading import local_path

from .files import Entry, Refused, file_table, hash_local
from .stats import Counters

log = logging.getLogger("service.tables")


class FileTables:
    def __init__(self, catalog: Catalog, counters: Counters, limit: int = 64):
        self.catalog, self.counters, self.limit = catalog, counters, limit
        self.tables: OrderedDict[tuple, dict[str, Entry]] = OrderedDict()
        self.pending: dict[tuple, asyncio.Task] = {}  # loads (and re-hashes) under way
        self.conditions: OrderedDict[tuple, Condition] = OrderedDict()  # by record and manifest stamp

    async def table(self, rec: Record) -> dict[str, Entry]:
        key = (rec.id, rec.manifest_sha256, rec.verified)
        if key in self.tables:
            self.tables.move_to_end(key)
            return self.tables[key]
        # a changed local set's manifest is not read at every request
        if local_path(rec.location) is not None:
            found = await asyncio.to_thread(self.condition, rec)
            if found.state == "changed":
                raise Refused(409, found.sentence(rec))
        return await self._once(key, self._load, key, rec)

    def condition(self, rec: Record, remote: bool = True) -> Condition:
        """``shards.catalog.condition`` of ``rec``, kept while its record and its manifest's stamp
        (a local file's size and modification time) stay the same. Blocking: call it in a thread."""
        url = storage.join(rec.location, MANIFEST_NAME)
        try:
            stamp = file_stamp(url) if rec.state == "ready" else None
        except FileNotFoundError:
            stamp = "gone"
        if stamp is None:  # not ready, or remote: nothing to key on
            return condition(rec, remote=remote)
        key = (rec.id, rec.state, rec.manifest_sha256, rec.verified, rec.verify_problems, stamp)
        if key not in self.conditions:
            self.conditions[key] = condition(rec)
            while len(self.conditions) > self.limit:
                self.conditions.popitem(last=False)
        return self.conditions[key]

    async def changed(self, rec: Record, name: str) -> None:
        """A local file of ``rec`` no longer looks as when it was last hashed: refused (409) if the
        set's manifest is no longer the registered one, else the file is hashed again and recorded
        (its ETag from now on)."""
        found = await asyncio.to_thread(self.condition, rec)
        if found.state == "changed":
            raise Refused(409, found.sentence(rec))
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
        table = await asyncio.to_thread(file_table, rec)
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
            problem = f"{name}: changed since it was last hashed, and its bytes are not the registered ones"
        log.warning("dataset %s: %s changed since it was last hashed; hashed again: %s", rec.id, name,
                    problem or "the same bytes")
        await asyncio.to_thread(self.catalog.record_file_verify, rec.id, name, [size, mtime, sha], problem)
        self.counters.add("reverified")
