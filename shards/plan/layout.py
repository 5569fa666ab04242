"""The shard-layout planner: recommended shard size and count, and a model of the filesystem
metadata operations (opens, stats, directory listings) per epoch for this layout, for a
frame-folder layout and for one file per video.

Shard opens are not estimated from a formula: they are counted on the real partition plan
(``shards.plan.partition``) of a hypothetical shard set of the recommended size, so the figures
are what the loader does. A rank opens each shard its range of the epoch order touches once
and its forked loader workers share the descriptor; where descriptors cannot be shared
(remote storage), each worker opens the shards its own chunk touches (the "per worker" column).

``traffic`` counts, the same way, the bytes and requests that cross the network per epoch when
the ranks of a node share a node cache, in the global mode and node-affine
(``partition.assign``), and what a node's cache holds.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from ..base.words import plural
from . import partition

MB = 1e6


@dataclass
class Totals:
    clips: int
    clip_bytes: float  # mean bytes per clip in a shard (its tar members)
    frames: int = 8

    @property
    def bytes(self) -> float:
        return self.clips * self.clip_bytes


@dataclass
class Ops:
    """Metadata operations in one epoch."""
    opens: float
    stats: float = 0
    listings: float = 0

    @property
    def total(self) -> float:
        return self.opens + self.stats + self.listings


def frame_folder_ops(clips: float, frames: int) -> Ops:
    """TSM/mmaction2 frame folders: a JPEG open per frame, and TSM's existence check (a stat)
    of the clip's first frame. Frame counts come from the list file, so no listing per epoch."""
    return Ops(opens=clips * frames, stats=clips)


def video_file_ops(clips: float) -> Ops:
    """One video file per clip read: an open, and a stat (existence/size check before decoding)."""
    return Ops(opens=clips, stats=clips)


def recommend(totals: Totals, target_bytes: float = 256 * MB, min_bytes: float = 8 * MB) -> tuple[int, int]:
    """(number of shards, clips per shard): shards near ``target_bytes``, never below ``min_bytes``
    unless the whole split is smaller."""
    shard_bytes = max(min_bytes, min(target_bytes, totals.bytes))
    count = max(1, math.ceil(totals.bytes / shard_bytes))
    return count, math.ceil(totals.clips / count)


def shard_opens(shard_sizes: list[int], world_size: int, workers: int, batch_size: int,
                seed: int = 0, epoch: int = 0) -> tuple[list[int], list[int]]:
    """Opens per rank (descriptors shared by its workers) and per rank with one open per worker
    and shard, counted on the real partition plan of one epoch."""
    order = partition.epoch_order(shard_sizes, seed, epoch)
    per_rank, per_worker = [], []
    for rank in range(world_size):
        streams = partition.streams(len(order), world_size, rank, workers, batch_size)
        touched = [{r.shard for r in order.slice(s.begin, s.end)} for s in streams]
        per_rank.append(len(set().union(*touched)))
        per_worker.append(sum(len(t) for t in touched))
    return per_rank, per_worker


def plan(totals: Totals, max_world: int, workers: int, batch_size: int, world_sizes: list[int],
         target_bytes: float = 256 * MB, num_shards: int | None = None,
         shard_sizes: list[int] | None = None) -> dict:
    """A layout and, per world size (the rows: ``world_sizes``, in order), per-rank and total
    metadata operations per epoch. The layout: ``shard_sizes`` (clips per shard: a built set's own),
    else ``num_shards`` even shards, else the recommendation for ``target_bytes``."""
    if shard_sizes:
        sizes, count, per_shard = list(shard_sizes), len(shard_sizes), max(shard_sizes)
    else:
        count = num_shards or recommend(totals, target_bytes)[0]
        per_shard = math.ceil(totals.clips / count)
        sizes = [totals.clips * (j + 1) // count - totals.clips * j // count for j in range(count)]
    rows = []
    for world in sorted(set(world_sizes)):
        share = partition.per_rank(totals.clips, world, batch_size)
        ranks, workers_opens = shard_opens(sizes, world, workers, batch_size)
        ours = Ops(opens=sum(ranks) + 1)  # + the manifest, read once by rank 0 and broadcast
        frames, videos = frame_folder_ops(world * share, totals.frames), video_file_ops(world * share)
        rows.append({
            "world_size": world, "clips_per_rank": share, "mb_per_rank": share * totals.clip_bytes / MB,
            "readers_per_shard": world * workers / count,
            "shards": {"opens_per_rank_mean": sum(ranks) / world, "opens_per_rank_max": max(ranks),
                       "opens_per_rank_per_worker_max": max(workers_opens), "stats": 0, "listings": 0,
                       "total": ours.total, "total_per_worker_opens": sum(workers_opens) + 1},
            "frame_folders": {"opens_per_rank": frames.opens / world, "stats_per_rank": frames.stats / world,
                              "listings": 0, "total": frames.total},
            "video_files": {"opens_per_rank": videos.opens / world, "stats_per_rank": videos.stats / world,
                            "listings": 0, "total": videos.total},
            "frame_folders_over_shards": frames.total / ours.total,
        })
    return {"clips": totals.clips, "clip_bytes": totals.clip_bytes, "frames": totals.frames,
            "max_world_size": max_world, "workers_per_rank": workers, "batch_size": batch_size,
            "num_shards": count, "clips_per_shard": per_shard, "shard_mb": per_shard * totals.clip_bytes / MB,
            "shard_clips": [min(sizes), max(sizes)],
            "layout": "set" if shard_sizes else "num_shards" if num_shards else "recommended", "rows": rows}


def _mb(n: float) -> str:
    return f"{n:,.0f} MB" if n >= 10 else f"{n:.1f} MB"


def recommendation(p: dict) -> str:
    """The recommended (or, with ``--num-shards``, the asked for) layout in one line."""
    head = "Planned (--num-shards)" if p.get("layout") == "num_shards" else "Recommended"
    return (f"{head}: {plural(p['num_shards'], 'shard')} of ~{p['clips_per_shard']:,} clips "
            f"(~{_mb(p['shard_mb'])}).")


def own_layout(p: dict) -> str:
    """A built set's layout in one line."""
    low, high = p["shard_clips"]
    clips = f"{high:,} clips" if low == high else f"{low:,}-{high:,} clips"
    return f"This set: {plural(p['num_shards'], 'shard')} of {clips} (up to ~{_mb(p['shard_mb'])})."


def explain(p: dict) -> str:
    """How ranks read a layout, and the trade-off of the shard size, in words."""
    top = p["rows"][-1]
    return "\n".join([
        "How ranks read: every epoch the shard order is shuffled and rotated (seeded by seed and epoch);",
        f"rank r reads one contiguous range of it: at {top['world_size']:,} ranks "
        f"{top['clips_per_rank']:,} clips ({top['mb_per_rank']:,.1f} MB),",
        "a byte range of one shard, sometimes two, found by the manifest's per-sample offsets. Its loader",
        "workers split the range by batches and share the rank's descriptors, so a rank opens each shard",
        "it touches once; nothing is listed or stat-ed. Where descriptors cannot be shared (remote",
        "storage) each worker opens its own: at most "
        f"{top['shards']['opens_per_rank_per_worker_max']} per rank at {top['world_size']:,} ranks.",
        "Trade-off: opens per epoch are about world size + shard count, so larger shards cost fewer",
        "metadata operations and give long sequential reads, but they are coarser units for the",
        "per-epoch shuffle of the shard order, for ingest's parallel writers, and for verify, staging",
        "to a node-local cache and retrying a failed transfer. Below a few MB a shard stops being an",
        "efficient sequential read. Readers outnumbering shards cost nothing extra here: at",
        f"{top['world_size']:,} ranks x {p['workers_per_rank']} workers about "
        f"{top['readers_per_shard']:,.0f} readers share each shard, each with its own byte range.",
    ])


def format_table(p: dict) -> str:
    """A layout's metadata operations per epoch, a row per world size, against frame folders and
    video files."""
    head = (f"{'ranks':>6} {'clips/rank':>10} {'MB/rank':>8} | {'shards: opens/rank':>18} {'total':>8} | "
            f"{'frame folders: ops/rank':>23} {'total':>10} | {'video files: ops/rank':>21} {'total':>9} | "
            f"{'ratio':>6}")
    lines = [head, "-" * len(head)]
    for r in p["rows"]:
        s, f, v = r["shards"], r["frame_folders"], r["video_files"]
        lines.append(
            f"{r['world_size']:>6} {r['clips_per_rank']:>10,} {r['mb_per_rank']:>8,.1f} | "
            f"{s['opens_per_rank_mean']:>9.2f} (max {s['opens_per_rank_max']:>3}) {s['total']:>8,.0f} | "
            f"{f['opens_per_rank'] + f['stats_per_rank']:>23,.0f} {f['total']:>10,.0f} | "
            f"{v['opens_per_rank'] + v['stats_per_rank']:>21,.0f} {v['total']:>9,.0f} | "
            f"{r['frame_folders_over_shards']:>5,.0f}x")
    return "\n".join(lines)


def format_plan(p: dict, own: dict | None = None) -> str:
    """The plan ``p`` (a recommendation) as text; ``own``: a built set's own layout, tabled first."""
    lines = [f"{p['clips']:,} clips x {p['clip_bytes'] / 1e3:,.0f} kB, {p['frames']} frames; "
             f"batch {p['batch_size']} per rank, {p['workers_per_rank']} loader workers per rank", ""]
    if own:
        lines += [own_layout(own), format_table(own), ""]
    lines += [recommendation(p), format_table(p), "",
              "ops = opens + stats + listings per epoch; "
              "shards total includes the manifest (1 open per job);",
              "ratio = frame-folder total / shard total.", "", explain(p)]
    return "\n".join(lines)


def _lru_misses(touches: list[set[int]], sizes: list[float], capacity: float) -> list[float]:
    """Bytes a node cache of whole shards downloads each epoch, evicting the least recently used
    when ``capacity`` (inf: never) is exceeded; ``touches``: the shards the node reads each epoch."""
    held, out = OrderedDict(), []
    for shards in touches:
        got = 0.0
        for s in sorted(shards):
            if s in held:
                held.move_to_end(s)
                continue
            held[s] = sizes[s]
            got += sizes[s]
            while sum(held.values()) > capacity and len(held) > 1:
                held.popitem(last=False)
        out.append(got)
    return out


def traffic(shard_sizes: list[int], clip_bytes: float, nodes: int, ranks_per_node: int, epochs: int,
            batch_size: int, seed: int = 0) -> dict:
    """Bytes and requests over the network in each epoch of a run, counted on the partition plans.

    Global mode (one order for all ranks, re-shuffled every epoch): the ranks reading byte ranges
    (no cache), or through a node cache of whole shards that never evicts or holds one epoch's
    shards. Node-affine (each node owns its pieces for the run): a node cache of its pieces, or of
    the whole shards they are cut from, or byte ranges (no cache, or a budget below the node's
    share, streamed through every epoch). Requests: one per run of a rank's range (ranges),
    one per shard or piece downloaded (caches).
    """
    world = nodes * ranks_per_node
    whole = [n * clip_bytes for n in shard_sizes]
    ranges = {"bytes": [], "requests": []}
    node_touches: list[list[set[int]]] = [[] for _ in range(nodes)]
    node_ranges = {"bytes": [], "requests": []}
    owned = partition.assign(shard_sizes, nodes, seed) if nodes > 1 else [partition.pieces(shard_sizes)]
    for epoch in range(epochs):
        order = partition.epoch_order(shard_sizes, seed, epoch)
        share = partition.per_rank(len(order), world, batch_size)
        runs = [order.slice(r * share, (r + 1) * share) for r in range(world)]
        ranges["bytes"].append(sum(run.size for rs in runs for run in rs) * clip_bytes)
        ranges["requests"].append(sum(len(rs) for rs in runs))
        for node in range(nodes):
            node_touches[node].append(
                {run.shard for rs in runs[node * ranks_per_node:(node + 1) * ranks_per_node] for run in rs})
        orders = partition.epoch_orders(shard_sizes, nodes, seed, epoch)
        lengths = tuple(len(o) for o in orders)
        share = partition.per_rank(lengths, world, batch_size)
        runs = [orders[r // ranks_per_node].slice((r % ranks_per_node) * share,
                                                  (r % ranks_per_node + 1) * share)
                for r in range(world)]
        node_ranges["bytes"].append(sum(run.size for rs in runs for run in rs) * clip_bytes)
        node_ranges["requests"].append(sum(len(rs) for rs in runs))
    never, one_epoch = [0.0] * epochs, [0.0] * epochs
    for touches in node_touches:
        capacity = sum(whole[s] for s in touches[0])
        for e, (a, b) in enumerate(zip(_lru_misses(touches, whole, math.inf),
                                       _lru_misses(touches, whole, capacity))):
            never[e] += a
            one_epoch[e] += b
    first = lambda total: [total] + [0.0] * (epochs - 1)  # noqa: E731  a cache that holds the node's share
    pieces = [r for runs in owned for r in runs]
    return {
        "dataset_bytes": sum(whole), "epochs": epochs, "nodes": nodes, "ranks": world,
        "node_share_bytes": max(sum(r.size for r in runs) for runs in owned) * clip_bytes,
        "largest_piece_bytes": max(r.size for r in pieces) * clip_bytes,
        "modes": {
            "global, byte ranges": ranges,
            "global, node cache of whole shards, never evicting": {"bytes": never, "requests": None},
            "global, node cache of whole shards, one epoch's": {"bytes": one_epoch, "requests": None},
            "node-affine, byte ranges (no cache or budget < share)": node_ranges,
            "node-affine, node cache of its pieces": {
                "bytes": first(sum(r.size for r in pieces) * clip_bytes), "requests": first(len(pieces))},
            "node-affine, node cache of whole shards": {
                "bytes": first(sum(whole[s] for runs in owned for s in {r.shard for r in runs})),
                "requests": first(sum(len({r.shard for r in runs}) for runs in owned))},
        },
    }
