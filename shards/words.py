"""Counts in words, for messages people read: ``plural(1, "shard")`` is "1 shard", ``plural(1536,
"rank")`` is "1,536 ranks", ``plural(2, "class", "classes")`` is "2 classes"."""
from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"
