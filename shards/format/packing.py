"""Cutting an ordered run of samples into shards, and writing one shard from sample bytes.

Used by ``ingest build`` (samples staged by workers) and ``shards reshard`` (samples cut
out of old shards): in both, each sample is already its own contiguous tar bytes.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

from ..io import storage
from . import tar
from .digests import sample_digest
from .manifest import ShardInfo


def cut(sizes: list[int], max_bytes: int | None = None, max_samples: int | None = None) -> list[range]:
    """Split samples (in order) into consecutive shards; never splits a sample.

    A shard closes before the sample that would push it past ``max_bytes`` (counting the
    end-of-archive blocks) or past ``max_samples``; a single oversized sample gets its own shard.
    """
    if not max_bytes and not max_samples:
        raise ValueError("need a shard size in bytes or in samples")
    out, start, size = [], 0, 0
    for i, n in enumerate(sizes):
        full_count = max_samples and i - start >= max_samples
        full_bytes = max_bytes and i > start and size + n + 2 * tar.BLOCK > max_bytes
        if full_count or full_bytes:
            out.append(range(start, i))
            start, size = i, 0
        size += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def shard_bytes(sample_sizes: Iterable[int]) -> int:
    """The size of a shard of samples of these sizes, its end-of-archive blocks included."""
    n = sum(sample_sizes)
    return n + len(tar.end_of_archive(n))


def write_shard(url: str, name: str, samples: Iterable[tuple[str, int, bytes]],
                size: int | None = None) -> ShardInfo:
    """Write ``(key, label, sample_bytes)`` in order as one tar shard, atomically (``size``, when
    known: the shard's, for the message of a full disk).

    Returns the shard's manifest entry (``name`` is its path relative to the manifest).
    """
    info = ShardInfo(name=name, num_samples=0, bytes=0, sha256="")
    h = hashlib.sha256()
    pos = 0
    with storage.AtomicWriter(url, size) as f:
        for key, label, data in samples:
            f.write(data)
            h.update(data)
            info.keys.append(key)
            info.offsets.append(pos)
            info.lengths.append(len(data))
            info.labels.append(label)
            info.digests.append(sample_digest(data))
            pos += len(data)
        tail = tar.end_of_archive(pos)
        f.write(tail)
        h.update(tail)
    info.num_samples = len(info.keys)
    info.bytes = pos + len(tail)
    info.sha256 = h.hexdigest()
    return info


def shard_name(split: str, index: int) -> str:
    return f"{split}/{split}-{index:06d}.tar"
