"""Rewrite a shard set with another shard size or count, copying tar bytes (no decoding).

Samples keep their stored order; only the cut points move. Every source shard is read whole,
once, and checked as ``shards verify`` checks it (size, SHA-256 against the manifest, each
sample's offset, length, members and key) before any of its bytes is copied, so a damaged
source never becomes a set with fresh, matching hashes. A damaged shard stops the reshard
with its name and what is wrong, and the shards written so far are removed; with
``--skip-bad`` damaged shards are left out (found in a first checking pass, so the cuts are
planned over the clips that remain) and the clips lost are reported. Source shards are read
``workers`` at a time ahead of the writer; the same input and options always give the same
bytes. The new manifest is written last, after the source's ``classes.txt`` and ``errors.jsonl``.
The destination must be empty or new: shards already there would lie beside the new manifest.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from fsspec.core import url_to_fs

from ..base.commands import byte_size, positive_int
from ..base.errors import NoSpace, UsageError
from ..base.words import plural
from ..format import packing
from ..format.manifest import CLASSES_NAME, LEDGER_NAME, Manifest, ShardInfo, SplitInfo, digest
from ..io import storage
from .verify import check_shard

log = logging.getLogger("shards.tools.reshard")


class BadShard(ValueError):
    def __init__(self, name: str, problems: list):
        super().__init__(f"{name}: " + "; ".join(str(p).split(": ", 1)[-1] for p in problems[:3]))
        self.name, self.problems = name, problems


def cuts(sizes: list[int], shard_bytes: int | None, shard_samples: int | None,
         num_shards: int | None) -> list[range]:
    """New shard boundaries: by size (``packing.cut``) or ``num_shards`` near-equal counts."""
    if num_shards:
        n = len(sizes)
        k = min(num_shards, n)
        return [range(n * j // k, n * (j + 1) // k) for j in range(k)]
    return packing.cut(sizes, shard_bytes, shard_samples)


def _read(m: Manifest, shard: ShardInfo) -> list[bytes]:
    """The shard's samples' bytes, once the whole shard has been checked; else ``BadShard``."""
    datas = []
    problems = check_shard(m.shard_url(shard), shard, keep=datas, motion=m.motion)
    if problems:
        raise BadShard(shard.name, problems)
    return datas


def _checked_samples(m: Manifest, shards: list[ShardInfo], pool: ThreadPoolExecutor, ahead: int):
    """(key, label, bytes) of every sample of ``shards`` in order, each shard checked whole
    before its first sample is yielded; up to ``ahead`` shards are read in advance."""
    futures = [pool.submit(_read, m, s) for s in shards[:ahead]]
    for i, shard in enumerate(shards):
        if i + ahead < len(shards):
            futures.append(pool.submit(_read, m, shards[i + ahead]))
        datas = futures[i].result()
        futures[i] = None  # let the shard's bytes go once copied
        yield from zip(shard.keys, shard.labels, datas)


def find_bad(m: Manifest, workers: int = 4) -> dict[str, list]:
    """Every damaged shard of the set: name -> its problems (one checking pass, nothing copied)."""
    shards = [s for split in m.splits.values() for s in split.shards]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        found = pool.map(lambda s: check_shard(m.shard_url(s), s, motion=m.motion), shards)
        return {s.name: p for s, p in zip(shards, found) if p}


def reshard(src: str, dst: str, shard_bytes: int | None = None, shard_samples: int | None = None,
            num_shards: int | None = None, workers: int = 4, skip_bad: bool = False) -> Manifest:
    """Write the resharded set to ``dst``. With ``skip_bad``, damaged source shards are left out and
    listed in the new manifest's ``config["resharded"]["dropped"]`` (name -> clips lost)."""
    if storage.join(src) == storage.join(dst):
        raise UsageError(f"{dst}: the destination must differ from the source")
    m = Manifest.load(src)
    fs, root = url_to_fs(dst)
    if fs.exists(root) and (not fs.isdir(root) or fs.ls(root, detail=False)):
        raise UsageError(f"{dst}: not empty; reshard into a new or empty directory")
    dropped = {}  # name -> clips lost
    if skip_bad:
        bad = find_bad(m, workers)
        for split in m.splits.values():
            for shard in split.shards:
                if shard.name in bad:
                    dropped[shard.name] = shard.num_samples
                    log.warning("skipping %s: %s", shard.name, "; ".join(str(p) for p in bad[shard.name][:3]))
    splits = {}
    try:
        with ThreadPoolExecutor(max(1, workers)) as pool:
            for name, split in m.splits.items():
                sources = [s for s in split.shards if s.name not in dropped]
                sizes = [n for s in sources for n in s.lengths]
                parts = cuts(sizes, shard_bytes, shard_samples, num_shards)
                samples = _checked_samples(m, sources, pool, max(1, workers))
                shards = []
                for j, part in enumerate(parts):
                    new = packing.shard_name(name, j)
                    shards.append(packing.write_shard(storage.join(dst, new), new,
                                                      itertools.islice(samples, len(part))))
                if next(samples, None) is not None:  # also checks trailing shards without samples
                    raise AssertionError("cuts do not cover every sample")
                lost = sum(dropped.get(s.name, 0) for s in split.shards)
                splits[name] = SplitInfo(shards=shards, num_failed=split.num_failed + lost,
                                         warnings=split.warnings)
                log.info("%s: %s in %s -> %s", name, plural(len(sizes), "sample"),
                         plural(len(sources), "shard"), plural(len(parts), "shard"))
    except (BadShard, NoSpace) as refused:
        # a refused reshard leaves nothing behind (the destination was empty)
        for entry in fs.ls(root, detail=False) if fs.exists(root) else []:
            fs.rm(entry, recursive=True)
        if isinstance(refused, NoSpace):
            raise NoSpace(f"{refused}; nothing is left in {dst}, the same command with room starts "
                          "afresh") from None
        raise
    layout = {"shard_bytes": shard_bytes, "shard_samples": shard_samples, "num_shards": num_shards}
    done = layout | ({"dropped": dropped} if dropped else {})
    for name in (CLASSES_NAME, LEDGER_NAME):  # what the set says besides its shards, when it has them
        try:
            storage.atomic_write(storage.join(dst, name), storage.read_bytes(storage.join(src, name)))
        except FileNotFoundError:
            pass
    out = Manifest(classes=m.classes, splits=splits, config=m.config | {"resharded": done},
                   fingerprint=digest({"source": m.fingerprint, "layout": done}))
    out.save(dst)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source shard-set directory URL")
    p.add_argument("dst", help="destination directory URL (a new shard set)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--shard-size", type=byte_size, help="largest shard, e.g. 256MB")
    size.add_argument("--shard-samples", type=positive_int, help="clips per shard")
    size.add_argument("--num-shards", type=positive_int,
                      help="this many shards per split, near-equal clip counts (at most one per clip)")
    p.add_argument("--workers", type=positive_int, default=4,
                   help="source shards read and checked at once (each is held in memory until copied)")
    p.add_argument("--skip-bad", action="store_true",
                   help="leave out source shards that fail their checks (and report the clips lost) "
                        "instead of refusing")


def run(args: argparse.Namespace) -> int:
    try:
        out = reshard(args.src, args.dst, args.shard_size, args.shard_samples,
                      args.num_shards, args.workers, args.skip_bad)
    except BadShard as e:
        print(f"error: {e}\nnothing written; `shards verify {args.src}` lists every problem, "
              f"--skip-bad leaves damaged shards out", file=sys.stderr)
        return 1
    dropped = out.config["resharded"].get("dropped", {})
    for name, clips in dropped.items():
        print(f"skipped damaged {name}: {plural(clips, 'clip')} lost")
    for name, split in out.splits.items():
        fewer = (f" (--num-shards {args.num_shards} is more than the clips allow)"
                 if args.num_shards and args.num_shards > len(split.shards) else "")
        print(f"{name}: {plural(split.num_samples, 'clip')} in {plural(len(split.shards), 'shard')}{fewer}")
    if dropped:
        print(f"{plural(sum(dropped.values()), 'clip')} lost in {plural(len(dropped), 'damaged shard')}")
    return 0
