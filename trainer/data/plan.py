"""The read plan: which bytes each loader worker reads and which samples it hands out, in which order.

Pure functions over frozen records, no I/O: ``shards.plan.partition`` decides the epoch's order and each
worker's stream of it; here a stream becomes a ``WorkerPlan``, built once: its ``Read`` s (the byte
ranges of shards to read, in order, each knowing its URL, the shard's manifest entry every sample is
checked against, and the node cache's copy it comes from when there is a cache), the keys those ranges
hold (each with its index in the plan, or None for a sample read only to keep a range whole), and the
order the worker hands its samples out in. The loader's stages (``trainer.data.stages``) carry it out.

Node-affine epochs with a cache: the node's cached copies are pieces of shards, the byte range of the
node's samples in each shard it owns (``node_pieces``); a read comes from its node's piece when the piece
holds it, else from the whole shard (``piece_of``); ``largest_copy`` is what any rank may ask its cache
for, the same number on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shards.format.manifest import ShardInfo
from shards.plan import partition
from shards.read.cache import Piece

# Bytes of samples not handed out that a read goes through rather than end and start another: a new read
# costs a request (remote) or a seek, about as much as reading this much more.
READ_GAP = 1 << 20


@dataclass(frozen=True)
class Read:
    """Bytes [start, end) of shard number ``shard`` of the split, at ``url``; ``info`` is its manifest entry
    (sizes, keys, per-sample digests); ``piece`` the cached copy it is read from (with a node cache)."""
    shard: int
    start: int
    end: int
    url: str
    info: ShardInfo
    piece: Piece | None = None


@dataclass(frozen=True)
class WorkerPlan:
    """What one loader worker reads and hands out for the rest of an epoch."""
    reads: tuple[Read, ...]
    # every key the reads hold, in file order: (key, plan index or None)
    expected: tuple[tuple[str, int | None], ...]
    order: tuple[int, ...]  # plan indices in the order they are handed out
    valid_locals: int  # plan indices from this one on are padding repeats


def worker_plan(shards: list[ShardInfo], urls: list[str], order: partition.Order, stream: partition.Stream,
                emitted: np.ndarray, skip: int, batch_size: int,
                pieces: dict[int, tuple[int, int]] | None = None) -> WorkerPlan:
    """The plan of ``stream`` (positions of ``order``) that hands out ``emitted`` (its plan indices in
    shuffled order) less its first ``skip`` batches; reads of consecutive runs of a shard at most
    ``READ_GAP`` bytes apart are one read. ``pieces``: the node's cached pieces (``node_pieces``), when
    reading through a cache."""
    todo = emitted[skip * batch_size:]
    wanted = np.zeros(stream.size, dtype=bool)
    wanted[todo] = True
    ranges, expected, local, stop = [], [], 0, 0  # stop: the sample after the last read's
    for run in order.slice(stream.begin, stream.end):
        hits = np.flatnonzero(wanted[local: local + run.size])
        if len(hits):
            shard = shards[run.shard]
            a, b = run.start + int(hits[0]), run.start + int(hits[-1]) + 1
            end = shard.offsets[b - 1] + shard.lengths[b - 1]
            if ranges and ranges[-1][0] == run.shard and 0 <= shard.offsets[a] - ranges[-1][2] <= READ_GAP:
                # runs that meet or nearly meet in the file (the order wraps inside a shard; rotation's clips
                # a few apart): one read, the samples between read and dropped
                expected += [(shard.keys[i], None) for i in range(stop, a)]
                ranges[-1][2] = end
            else:
                ranges.append([run.shard, shard.offsets[a], end])
            expected += [(shard.keys[i], local + i - run.start if wanted[local + i - run.start] else None)
                         for i in range(a, b)]
            stop = b
        local += run.size
    reads = tuple(Read(i, start, end, urls[i], shards[i],
                       None if pieces is None else piece_of(shards[i], urls[i], start, end, pieces.get(i)))
                  for i, start, end in ranges)
    return WorkerPlan(reads, tuple(expected), tuple(int(i) for i in todo), stream.valid_end - stream.begin)


def node_pieces(shards: list[ShardInfo], nodes: int, seed: int) -> list[dict[int, tuple[int, int]]]:
    """What each node's cache holds of each shard it owns (node-affine): the byte range of its samples
    there, when that is not the whole shard; one dict per node."""
    if nodes == 1:
        return [{}]
    out = []
    for runs in partition.assign([s.num_samples for s in shards], nodes, seed):
        out.append({})
        for run in runs:
            shard = shards[run.shard]
            if run.size < shard.num_samples:
                out[-1][run.shard] = (shard.offsets[run.start],
                                      shard.offsets[run.stop - 1] + shard.lengths[run.stop - 1])
    return out


def largest_copy(shards: list[ShardInfo], pieces: list[dict[int, tuple[int, int]]],
                 whole_shards: bool) -> int:
    """The largest copy any rank of the job may ask its cache for this epoch: the same number on every
    rank, so that a budget too small for it is refused by every rank or by none (a rank refusing alone
    would leave the others in a collective). Whole shards wherever a node owns one whole, or reads one
    (``whole_shards``: the global mode, or an epoch resumed after the node count changed), else pieces."""
    if whole_shards:
        return max(s.bytes for s in shards)
    split = {i for node in pieces for i in node}
    return max([end - start for node in pieces for start, end in node.values()]
               + [s.bytes for i, s in enumerate(shards) if i not in split])


def piece_of(shard: ShardInfo, url: str, start: int, end: int, piece: tuple[int, int] | None) -> Piece:
    """The cached copy bytes [start, end) of ``shard`` come from: the node's ``piece`` of it if that holds
    them (it may not, for the rest of an epoch after the node count changed), else the whole shard."""
    first, last = piece or (0, None)
    if not (first <= start and (last is None or end <= last)):
        first, last = 0, None
    return Piece(url, shard.sha256, shard.bytes, first, last, checked=bool(shard.digests))
