"""Rewrite a shard set with another shard size or count, copying tar bytes (no decoding).

Samples keep their stored order; only the cut points move. Each new shard is written by
streaming byte ranges of the old shards (one open per old shard it draws from), so the
same input and options always give the same bytes. A new manifest is written last.
"""
from __future__ import annotations

import argparse
import logging
from concurrent.futures import ThreadPoolExecutor

from . import packing, storage, tarformat
from .manifest import Manifest, ShardInfo, SplitInfo, digest
from .reading import iter_samples

log = logging.getLogger("shards.reshard")


def _source_runs(shards: list[ShardInfo], start: int, stop: int):
    """Global sample range [start, stop) of a split as (shard, first, end) runs."""
    base = 0
    for shard in shards:
        a, b = max(start, base), min(stop, base + shard.num_samples)
        if a < b:
            yield shard, a - base, b - base
        base += shard.num_samples


def _samples(manifest: Manifest, shards: list[ShardInfo], start: int, stop: int):
    """(key, label, tar bytes) of global samples [start, stop), each checked to be its key's members."""
    for shard, a, b in _source_runs(shards, start, stop):
        for i, data in iter_samples(manifest.shard_url(shard), shard, a, b):
            names = [name for name, _ in tarformat.read_members(data)]
            key = shard.keys[i]
            if not names or any(tarformat.split_name(n)[0] != key for n in names):
                raise ValueError(f"{shard.name}: bytes at sample {key}'s offset are not its members")
            yield key, shard.labels[i], data


def cuts(sizes: list[int], shard_bytes: int | None, shard_samples: int | None, num_shards: int | None) -> list[range]:
    """New shard boundaries: by size (``packing.cut``) or ``num_shards`` near-equal counts."""
    if num_shards:
        n = len(sizes)
        k = min(num_shards, n)
        return [range(n * j // k, n * (j + 1) // k) for j in range(k)]
    return packing.cut(sizes, shard_bytes, shard_samples)


def _write(m: Manifest, shards: list[ShardInfo], dst: str, name: str, part: range) -> ShardInfo:
    return packing.write_shard(storage.join(dst, name), name, _samples(m, shards, part.start, part.stop))


def reshard(src: str, dst: str, shard_bytes: int | None = None, shard_samples: int | None = None,
            num_shards: int | None = None, workers: int = 4) -> Manifest:
    if storage.join(src) == storage.join(dst):
        raise ValueError("the destination must differ from the source")
    m = Manifest.load(src)
    splits = {}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for name, split in m.splits.items():
            sizes = [n for s in split.shards for n in s.lengths]
            parts = cuts(sizes, shard_bytes, shard_samples, num_shards)
            futures = [pool.submit(_write, m, split.shards, dst, packing.shard_name(name, j), part)
                       for j, part in enumerate(parts)]
            splits[name] = SplitInfo(shards=[f.result() for f in futures], num_failed=split.num_failed)
            log.info("%s: %d samples in %d shards -> %d shards", name, len(sizes), len(split.shards), len(parts))
    layout = {"shard_bytes": shard_bytes, "shard_samples": shard_samples, "num_shards": num_shards}
    out = Manifest(classes=m.classes, splits=splits, config=m.config | {"resharded": layout},
                   fingerprint=digest({"source": m.fingerprint, "layout": layout}))
    out.save(dst)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source shard-set directory URL")
    p.add_argument("dst", help="destination directory URL (a new shard set)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--shard-size", help="largest shard, e.g. 256MB")
    size.add_argument("--shard-samples", type=int, help="clips per shard")
    size.add_argument("--num-shards", type=int, help="this many shards per split, near-equal clip counts")
    p.add_argument("--workers", type=int, default=4, help="shards written at once")


def run(args: argparse.Namespace) -> int:
    out = reshard(args.src, args.dst, packing.parse_size(args.shard_size), args.shard_samples,
                  args.num_shards, args.workers)
    for name, split in out.splits.items():
        print(f"{name}: {split.num_samples} clips in {len(split.shards)} shards")
    return 0
