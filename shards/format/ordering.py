"""Seeded, order-independent shuffling of sample keys.

Each key's position comes from a hash of (seed, key), so the order does not depend on the
order in which workers finish, and a failed sample does not move any other.
"""
from __future__ import annotations

import hashlib


def key_rank(seed: int, key: str) -> bytes:
    return hashlib.sha256(f"{seed}\0{key}".encode()).digest()


def shuffled(keys, seed: int) -> list:
    return sorted(keys, key=lambda k: key_rank(seed, k))
