"""Sizes as people write them: ``parse_size`` (flags, environment variables, request bodies)."""
from __future__ import annotations


def parse_size(text: str | int | None) -> int | None:
    """'256MB', '1.5GiB', '200k', '4096' -> bytes (decimal units, binary with 'i')."""
    if text is None or isinstance(text, int):
        return text
    t = text.strip().lower().rstrip("b")
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * units[suffix])
    return int(float(t))
