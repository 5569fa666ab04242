"""What the server has carried, counted per worker process in memory all of them share.

``serve --workers N`` forks N processes after this memory is mapped (anonymous, shared), one
row of counters each; a process only ever writes its own row (from its event loop, one thread),
so no lock is needed, and any worker answers ``GET /v1/stats`` with every row and their sums.
"""
from __future__ import annotations

import mmap
import os

FIELDS = ("requests", "shard_requests", "shard_bytes", "redirects", "manifest_parses", "table_waiting",
          "reverified", "accel_redirects", "grants")


class Counters:
    def __init__(self, workers: int = 1):
        self.workers, self.row = workers, 0
        self._mem = mmap.mmap(-1, 8 * len(FIELDS) * workers)
        self._cells = memoryview(self._mem).cast("q")

    def in_worker(self, row: int) -> None:
        """In forked worker ``row``: count into that row from now on."""
        self.row = row

    def add(self, field: str, n: int = 1) -> None:
        self._cells[self.row * len(FIELDS) + FIELDS.index(field)] += n

    def rows(self) -> list[dict]:
        k = len(FIELDS)
        return [dict(zip(FIELDS, self._cells[r * k:(r + 1) * k].tolist())) for r in range(self.workers)]

    def to_json(self) -> dict:
        rows = self.rows()
        return {"pid": os.getpid(), "worker": self.row, "workers": rows,
                "total": {f: sum(r[f] for r in rows) for f in FIELDS}}
