"""Catalog lookups for the file-serving hot path, reused until the catalog changes, and through an
outage of its server for a bounded time.

A shard read would otherwise cost four SQL queries and a record's JSON decoding. Instead the
answer to each reference is kept, and confirmed again once anything has committed to the catalog
since (``Catalog.generation``): on a SQLite file, SQLite's ``PRAGMA data_version``, which changes
with every commit by any other connection, of this process or another, so a request never sees a
record older than the last commit before it; on PostgreSQL, the notifications every write
transaction sends, which reach every replica within milliseconds of the commit (its own commits at
once), and a reconnection after the server was lost. That costs nothing per request, where asking
PostgreSQL for a generation number would cost a round trip (``bench/service.py --catalog-cost``).

A commit invalidates by generation, and throws nothing away:

  1. an answer looked up before the generation moved is *unconfirmed* from the moment this cache
     first sees it move (the next request: a serving replica sees a commit within milliseconds);
  2. an unconfirmed answer is looked up again at its next request; what the catalog answers then
     replaces it (a set removed, replaced or found damaged is refused from then on);
  3. if the catalog cannot be reached (``CatalogUnavailable``), the unconfirmed answer is still
     served, for less than ``stale_seconds`` after it became unconfirmed (``shard-service serve
     --catalog-staleness``, by default ``STALE_SECONDS``, 5 minutes; 0: never): the bound on how
     long a change made just before an outage can go unseen. Past it, and for a reference this
     replica never looked up, the request is 503 as before, with a log line naming the bound;
  4. while the catalog is away it is asked again once its listener is back (the generation moves)
     or ``RETRY_SECONDS`` after it last failed, not at every request.

An answer never invalidated (no commit since it was looked up) is current whatever the catalog's
state: no commit can happen while the server is down, and the listener's reconnection moves the
generation (commits may have been missed). One log line when the replica starts serving from its
last known records, one when the catalog answers again.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from shards.catalog import Catalog, CatalogUnavailable, Record

log = logging.getLogger("service.records")
STALE_SECONDS = 300.0  # how long an unconfirmed record is served while the catalog cannot be reached
RETRY_SECONDS = 1.0  # how often the catalog is asked again while it cannot be reached


@dataclass
class _Known:
    record: Record | None
    unconfirmed: float | None = None  # monotonic time this cache first saw a commit after the lookup


@dataclass
class _Outage:
    error: CatalogUnavailable
    since: float
    generation: object
    retry: float  # monotonic time from which the catalog is asked again whatever the generation


class RecordCache:
    """``Catalog.resolve`` answers, confirmed again after every commit to the catalog and served
    unconfirmed for ``stale_seconds`` while it cannot be reached (module docstring). One thread only."""

    def __init__(self, catalog: Catalog, limit: int = 1024, stale_seconds: float = STALE_SECONDS):
        self.catalog, self.limit, self.stale_seconds = catalog, limit, stale_seconds
        self.version, self.records = None, OrderedDict()  # ref -> _Known, least recently used first
        self.outage: _Outage | None = None

    def resolve(self, ref: str) -> Record | None:
        now, version = time.monotonic(), self.catalog.generation()
        if version != self.version:
            self.version = version
            for known in self.records.values():
                if known.unconfirmed is None:
                    known.unconfirmed = now
        known = self.records.get(ref)
        if known is not None:
            self.records.move_to_end(ref)
            if known.unconfirmed is None:
                return known.record
        if self.outage is not None and version == self.outage.generation and now < self.outage.retry:
            return self._last_known(ref, known, now)
        try:
            record = self.catalog.resolve(ref)
        except CatalogUnavailable as e:
            if self.outage is None:
                self.outage = _Outage(e, now, version, now + RETRY_SECONDS)
                log.warning("%s: serving the sets this replica has looked up from their last known records, "
                            "each for at most %g s after a commit it could not check", e, self.stale_seconds)
            else:
                self.outage.error, self.outage.generation, self.outage.retry = e, version, now + RETRY_SECONDS
            return self._last_known(ref, known, now)
        if self.outage is not None:
            log.warning("the catalog %s answers again after %.1f s: records are checked against it again",
                        self.catalog.where, now - self.outage.since)
            self.outage = None
        self.records[ref] = _Known(record)
        self.records.move_to_end(ref)
        while len(self.records) > self.limit:
            self.records.popitem(last=False)
        return record

    def _last_known(self, ref: str, known: _Known | None, now: float) -> Record | None:
        """``ref``'s last known answer while the catalog cannot be reached, within the staleness bound."""
        if known is None:
            raise CatalogUnavailable(str(self.outage.error))
        if now - known.unconfirmed >= self.stale_seconds:
            raise CatalogUnavailable(f"{self.outage.error}; the last known record of {ref!r} has gone "
                                     f"unconfirmed for {now - known.unconfirmed:.1f} s, past the staleness "
                                     f"bound of {self.stale_seconds:g} s (--catalog-staleness)")
        return known.record

    def close(self) -> None:
        self.catalog.close()
