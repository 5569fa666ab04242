"""Which samples each rank and loader worker reads, and in which order: pure functions, no I/O.

An epoch is planned in three steps, each a function of a few integers:

1. ``epoch_order``: the split's shards (cut into pieces of at most ``piece_samples`` when
   asked) in an order shuffled by (seed, epoch), then rotated by a random offset, as one
   ``Order`` of runs (a run is a contiguous sample range of one shard, read with one open).
2. ``streams``: every rank gets the same ``per_rank`` samples, a multiple of the batch size.
   With ``remainder="pad"`` the order is repeated from its start to fill the last batches
   (those positions are marked invalid); with ``"drop"`` its tail is left out this epoch.
   Rank r reads the contiguous positions [r * per_rank, (r + 1) * per_rank): few opens, and
   ranks beyond the shard count simply read byte ranges of shards. The rank's batch b is made
   by loader worker b % num_workers (the order PyTorch's DataLoader collects them in), and
   each worker reads one contiguous chunk of the rank's range.
3. ``buffer_shuffle``: each worker reorders its chunk through a bounded buffer, seeded by
   (seed, epoch, segment, rank, worker), so the emission order is known without reading data.

Because the whole order is a function of integers, a mid-epoch position is just "k batches
done"; ``remaining`` turns that into the still-unread samples when the world size changes
(a new *segment* of the epoch, as in MosaicML streaming's elastic resumption).

Node-affine epochs (``nodes`` > 1; a node is the ranks that share a host) make step 1 per node,
so that a node cache downloads each shard once per run instead of every epoch:

a. ``assign``: for the whole run, the shards in an order shuffled by the seed alone, cut at the
   sample positions n * k // nodes: node k owns the runs between its two cuts (whole shards and,
   at its ends, a contiguous piece of a shard it shares with a neighbour; with fewer shards
   than nodes, only pieces). Nodes differ by at most one sample.
b. ``epoch_orders``: each epoch, node k's runs shuffled and rotated by (seed, epoch, k): one
   ``Order`` per node. Step 2 then splits node k's order among its ``world_size // nodes``
   ranks (rank r is on node r // ranks_per_node). Every function below that takes ``n`` takes
   either one order's length or the tuple of every node's: the share is the same on every rank
   of the job (the largest node's with ``"pad"``, the smallest's with ``"drop"``), and a node
   pads from its own order. One node is the global mode: ``epoch_orders(..., nodes=1)`` is
   ``[epoch_order(...)]``.
c. Resume: ``remaining`` keeps each node's unread samples on that node; a segment with another
   node count (or one where a node has nothing left and others do) regroups them into contiguous
   balanced parts (``regroup``): every clip still once; the new count's assignment takes over at
   the next epoch.

Why one file of about 380 lines: the numbered steps above are carried out by the functions
below in the same order, and the node-affine steps (a-c) reuse steps 1-3 on each node's order;
apart, they would read as two plans of one thing.
"""
from __future__ import annotations

import hashlib
import random
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable, Iterator, Sequence

import numpy as np

REMAINDERS = ("pad", "drop")
Sizes = int | Sequence[int]  # one order's length, or each node's order's length


@dataclass(frozen=True, slots=True)
class Run:
    """Samples [start, stop) of shard ``shard`` (its index in the split's shard list)."""
    shard: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class Order:
    """A sequence of runs addressed by position; positions past the end wrap around."""

    def __init__(self, runs: Iterable[Run]):
        self.runs = [r for r in runs if r.size > 0]
        self.ends = list(accumulate(r.size for r in self.runs))

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def slice(self, begin: int, end: int) -> list[Run]:
        """The runs covering positions [begin, end), wrapping past the end (padding)."""
        n, out = len(self), []
        while begin < end:
            a = begin % n
            b = min(n, a + end - begin)
            i = bisect_right(self.ends, a)
            pos = a
            while pos < b:
                run, run_end = self.runs[i], self.ends[i]
                offset = run.start + pos - (run_end - run.size)
                upto = min(b, run_end)
                out.append(Run(run.shard, offset, offset + upto - pos))
                pos, i = upto, i + 1
            begin += b - a
        return out

    def locate(self, position: int) -> tuple[int, int]:
        """(shard, sample index in shard) at ``position``."""
        (run,) = self.slice(position, position + 1)
        return run.shard, run.start


def rng_for(*parts) -> random.Random:
    """A generator seeded by a stable hash of ``parts`` (same in every process and Python)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def at_least(what: str, value: int, low: int = 1) -> int:
    """``value``, refused (``ValueError`` naming ``what``) below ``low``: a count the plan divides by or
    splits into (a batch, a rank, a worker, a node, a piece) is 1 or more."""
    if value < low:
        raise ValueError(f"{what} {value}: give {low} or more")
    return value


def pieces(shard_sizes: list[int], piece_samples: int | None = None) -> list[Run]:
    """Each shard as one run, or cut into near-equal runs of at most ``piece_samples``."""
    return cut([Run(shard, 0, size) for shard, size in enumerate(shard_sizes)], piece_samples)


def cut(runs: Iterable[Run], piece_samples: int | None = None) -> list[Run]:
    """Each run as it is, or cut into near-equal runs of at most ``piece_samples``."""
    out = []
    for run in runs:
        k = 1 if piece_samples is None else max(1, -(-run.size // at_least("piece_samples", piece_samples)))
        bounds = [run.start + run.size * j // k for j in range(k + 1)]
        out.extend(Run(run.shard, a, b) for a, b in zip(bounds, bounds[1:]))
    return out


def shuffled(runs: Iterable[Run], rng: random.Random) -> Order:
    """``runs`` in a random order, rotated by a random offset.

    The rotation moves rank boundaries to new places inside shards every epoch, so the same
    samples do not meet in the same batches epoch after epoch.
    """
    runs = list(runs)
    rng.shuffle(runs)
    order = Order(runs)
    n = len(order)
    if n == 0:
        return order
    offset = rng.randrange(n)
    return Order(order.slice(offset, offset + n))


def epoch_order(shard_sizes: list[int], seed: int, epoch: int, shuffle: bool = True,
                piece_samples: int | None = None) -> Order:
    """The epoch's global order: pieces shuffled by (seed, epoch), rotated by a random offset.
    Without ``shuffle``: stored order."""
    runs = pieces(shard_sizes, piece_samples)
    return shuffled(runs, rng_for("order", seed, epoch)) if shuffle else Order(runs)


def assign(shard_sizes: list[int], nodes: int, seed: int) -> list[list[Run]]:
    """The runs node k owns for the whole run (step a of the module docstring)."""
    runs = pieces(shard_sizes)
    rng_for("assign", seed).shuffle(runs)
    order = Order(runs)
    n = len(order)
    if not 0 < nodes <= n:
        raise ValueError(f"cannot give each of {nodes} nodes a share of {n} samples")
    return [order.slice(n * k // nodes, n * (k + 1) // nodes) for k in range(nodes)]


def epoch_orders(shard_sizes: list[int], nodes: int, seed: int, epoch: int, shuffle: bool = True,
                 piece_samples: int | None = None) -> list[Order]:
    """One order per node for the epoch (step b); ``nodes=1``: the global order."""
    if nodes == 1:
        return [epoch_order(shard_sizes, seed, epoch, shuffle, piece_samples)]
    out = []
    for node, runs in enumerate(assign(shard_sizes, nodes, seed)):
        runs = cut(runs, piece_samples)
        out.append(shuffled(runs, rng_for("node order", seed, epoch, node)) if shuffle else Order(runs))
    return out


def regroup(orders: list[Order], nodes: int) -> list[Order]:
    """``orders`` as they are when there are ``nodes`` of them and none is empty while another
    is not; else their runs, one after the other, cut into ``nodes`` contiguous balanced parts."""
    sizes = [len(o) for o in orders]
    if len(orders) == nodes and (all(sizes) or not any(sizes)):
        return orders
    whole = Order(r for o in orders for r in o.runs)
    n = len(whole)
    return [Order(whole.slice(n * k // nodes, n * (k + 1) // nodes)) for k in range(nodes)]


def sizes_of(n: Sizes) -> tuple[int, ...]:
    return (int(n),) if isinstance(n, (int, np.integer)) else tuple(n)


def ranks_per_node(world_size: int, nodes: int) -> int:
    if world_size % at_least("nodes", nodes) or not at_least("world size", world_size):
        raise ValueError(f"world size {world_size} is not a whole number of ranks on each of {nodes} nodes")
    return world_size // nodes


def per_rank(n: Sizes, world_size: int, batch_size: int, remainder: str = "pad") -> int:
    """Samples each rank reads per epoch: equal on every rank, a whole number of batches.

    ``"pad"`` rounds up (at least one batch whenever n > 0); ``"drop"`` rounds down, to 0 when
    n < world_size * batch_size (callers that must hand every rank work check for that).
    """
    return batches_per_rank(n, world_size, batch_size, remainder) * batch_size


def batches_per_rank(n: Sizes, world_size: int, batch_size: int, remainder: str = "pad") -> int:
    """Batches each rank reads per epoch (``per_rank`` samples in batches of ``batch_size``)."""
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {REMAINDERS}, not {remainder!r}")
    sizes = sizes_of(n)
    step = ranks_per_node(world_size, len(sizes)) * at_least("batch_size", batch_size)
    counts = [k // step + (remainder == "pad" and k % step > 0) for k in sizes]
    batches = max(counts) if remainder == "pad" else min(counts)
    if batches and not all(sizes):
        raise ValueError(f"a node without samples cannot pad {batches} batches (node sizes {list(sizes)})")
    return batches


def worker_batches(num_batches: int, num_workers: int, worker: int, done: int = 0) -> int:
    """How many of batches [done, num_batches) fall to ``worker`` (batch b -> worker b % W)."""
    at_least("num_workers", num_workers)
    def upto(k):  # batches b < k with b % W == worker
        return max(0, (k - worker + num_workers - 1) // num_workers)
    return upto(num_batches) - upto(done)


@dataclass(frozen=True)
class Stream:
    """One loader worker's share of a rank's epoch: positions [begin, end) of its node's padded order."""
    rank: int
    worker: int
    begin: int
    end: int
    valid_end: int  # positions >= valid_end repeat earlier samples (padding)
    node: int = 0  # which node's order the positions are in

    @property
    def size(self) -> int:
        return self.end - self.begin


def streams(n: Sizes, world_size: int, rank: int, num_workers: int, batch_size: int,
            remainder: str = "pad") -> list[Stream]:
    """The ``num_workers`` streams of ``rank`` over its node's order (of ``n`` samples, or
    ``n[node]``)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    sizes = sizes_of(n)
    node, local = divmod(rank, ranks_per_node(world_size, len(sizes)))
    share = per_rank(sizes, world_size, batch_size, remainder)
    begin, out = local * share, []
    for w in range(at_least("num_workers", num_workers)):
        size = worker_batches(share // batch_size, num_workers, w) * batch_size
        out.append(Stream(rank, w, begin, begin + size, sizes[node], node))
        begin += size
    return out


def buffer_shuffle(items: Iterable, bufsize: int, rng: random.Random) -> Iterator:
    """Reorder a stream through a buffer of ``bufsize``: once full, each new item takes the
    place of a randomly chosen one, which is emitted; the rest leave in random order at the end."""
    if bufsize <= 1:
        yield from items
        return
    buf = []
    for item in items:
        if len(buf) < bufsize:
            buf.append(item)
            continue
        k = rng.randrange(bufsize)
        yield buf[k]
        buf[k] = item
    rng.shuffle(buf)
    yield from buf


def emission(stream: Stream, bufsize: int, seed: int, epoch: int, segment: int = 0) -> list[int]:
    """The order (local indices 0..size-1) in which ``stream`` emits its samples."""
    rng = rng_for("buffer", seed, epoch, segment, stream.rank, stream.worker)
    return list(buffer_shuffle(range(stream.size), bufsize, rng))


@dataclass(frozen=True)
class Segment:
    """A stretch of an epoch run with one world size: its settings and batches done per rank."""
    world_size: int
    num_workers: int
    batch_size: int
    batches_done: int = 0
    nodes: int = 1  # the orders the ranks were split over (1: the global mode)


def remaining(orders: list[Order], seg: Segment, remainder: str, bufsize: int, seed: int, epoch: int,
              segment: int) -> list[Order]:
    """The samples of each node's order that segment number ``segment`` had not handed out yet, as
    new orders, one per node (stored order kept, so runs stay long).

    Samples left out by ``remainder="drop"`` stay left out; padding repeats count as nothing.
    """
    sizes = tuple(len(o) for o in orders)
    share = per_rank(sizes, seg.world_size, seg.batch_size, remainder)
    ranks = ranks_per_node(seg.world_size, len(orders))
    out = []
    for node, order in enumerate(orders):
        n = len(order)
        todo = np.zeros(n, dtype=bool)
        todo[: min(n, ranks * share)] = True
        for rank in range(node * ranks, (node + 1) * ranks):
            for s in streams(sizes, seg.world_size, rank, seg.num_workers, seg.batch_size, remainder):
                done = worker_batches(seg.batches_done, seg.num_workers, s.worker) * seg.batch_size
                if done:
                    local = np.asarray(emission(s, bufsize, seed, epoch, segment)[:done]) + s.begin
                    todo[local[local < n]] = False
        runs, pos = [], 0
        for run in order.runs:
            runs += kept(run, todo[pos: pos + run.size])
            pos += run.size
        out.append(Order(runs))
    return out


def kept(run: Run, mask: np.ndarray) -> list[Run]:
    """The stretches of ``run`` where ``mask`` (one bool per sample of the run) is True, in order."""
    # starts and ends of True stretches
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return [Run(run.shard, run.start + int(a), run.start + int(b)) for a, b in zip(edges[::2], edges[1::2])]


def segment_orders(base: list[Order], past: list[Segment], remainder: str, bufsize: int, seed: int,
                   epoch: int, nodes: int) -> list[Order]:
    """What is left of the epoch's orders ``base`` (made for ``past[0].nodes`` nodes) after the
    completed segments ``past``, as ``nodes`` orders for the next segment."""
    orders = base
    for i, seg in enumerate(past):
        orders = remaining(regroup(orders, seg.nodes), seg, remainder, bufsize, seed, epoch, i)
    return regroup(orders, nodes)


def segment_order(base: Order, past: list[Segment], remainder: str, bufsize: int, seed: int,
                  epoch: int) -> Order:
    """``segment_orders`` in the global mode: one order for all ranks."""
    (order,) = segment_orders([base], past, remainder, bufsize, seed, epoch, 1)
    return order


def rank_sequence(n: Sizes, seg: Segment, rank: int, remainder: str, bufsize: int, seed: int,
                  epoch: int, segment: int = 0) -> list[int]:
    """Positions (in its node's padded order) that ``rank`` receives after ``seg.batches_done``
    batches, in the order its DataLoader yields them: batch b from worker b % num_workers."""
    per_worker = []
    for s in streams(n, seg.world_size, rank, seg.num_workers, seg.batch_size, remainder):
        order = emission(s, bufsize, seed, epoch, segment)
        per_worker.append([s.begin + i for i in order])
    out = []
    for b in range(seg.batches_done, batches_per_rank(n, seg.world_size, seg.batch_size, remainder)):
        w, j = b % seg.num_workers, b // seg.num_workers
        out.extend(per_worker[w][j * seg.batch_size:(j + 1) * seg.batch_size])
    return out


def step_samples(n: Sizes, seg: Segment, remainder: str, bufsize: int, seed: int, epoch: int,
                 segment: int = 0, parts: tuple[int, ...] | None = None) -> list:
    """Samples of the order (padding repeats left out) in each global step after
    ``seg.batches_done``: batch b of every rank makes step b, so this is the number of real
    clips an optimizer step averages over. Only streams that reach past the order's end hold
    padding, so only their emission orders are computed.

    ``parts`` (clip counts adding up to the batch size) cuts every batch into consecutive parts,
    each an optimizer step of its own (multigrid's short cycle): then each batch gives a list,
    the real clips of each part over all ranks."""
    cuts = parts or (seg.batch_size,)
    if sum(cuts) != seg.batch_size:
        raise ValueError(f"parts {list(cuts)} do not add up to the batch of {seg.batch_size}")
    steps = batches_per_rank(n, seg.world_size, seg.batch_size, remainder)
    counts = np.tile(np.asarray(cuts) * seg.world_size, (steps, 1))
    starts = np.cumsum((0, *cuts[:-1]))
    for rank in range(seg.world_size):
        for s in streams(n, seg.world_size, rank, seg.num_workers, seg.batch_size, remainder):
            if s.valid_end < s.end:  # the worker's j-th batch is the rank's batch j * workers + worker
                local = np.asarray(emission(s, bufsize, seed, epoch, segment)) + s.begin
                padding = np.add.reduceat((local >= s.valid_end).reshape(-1, seg.batch_size), starts, axis=1)
                counts[s.worker::seg.num_workers][:len(padding)] -= padding
    counts = counts[seg.batches_done:]
    return counts.tolist() if parts else counts[:, 0].tolist()
