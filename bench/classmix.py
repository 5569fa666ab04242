"""The class-mix guard's scale (``shards.plan.classmix``) on the benchmarks' layouts and Kinetics': what
ingest's hashed order gives against orders that give nodes different classes.

For each layout (shards x clips per shard, classes, clips per video, nodes) and stored order, the
labels are laid out in that order, cut into shards, shared out by ``partition.assign`` and judged
by ``classmix.class_mix``; printed: the worst node's total variation distance from the whole set,
how far that is beyond a random order's (the mean over ``classmix.ROUNDS`` permutations of the same
labels), the guard's limit for that excess (``MARGIN``, or ``SPREADS`` random spreads when larger),
and the classes a node's share holds, over ``--orders`` run seeds (``partition.assign`` shares whole
shards out with the seed, so a class-sorted set of few shards gives other shares at each). Orders:

* hashed: every clip at a random place (ingest's order), another at each seed;
* videos: videos at random places, a video's clips together (a tool that writes video by video);
* halves: the first half of the classes, then the second, each hashed (a second batch of
  classes appended to a set);
* sorted: class by class (a tool that writes class folders in turn).

With ``--power``, the guard's power instead: over a grid of 2, 4 and 8 nodes, 2 to 400 classes and
shard layouts, how often a class-sorted set passes (the false-pass rate: node-affine epochs trained on
a set whose nodes hold their own classes) with the node test alone (``Mix.shares_mixed``, the guard
before issue 42) and with the stored-order test too (``Mix.mixed``), and how often a hashed set is
refused (the false-refusal rate), over ``--orders`` run seeds a cell:

    python bench/classmix.py [--orders 100] [--large-orders 10]
    python bench/classmix.py --power [--orders 100]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shards.plan import classmix, partition  # noqa: E402

# (name, shards, clips per shard, classes, clips per video, nodes)
LAYOUTS = [("schedules / motion sets, 2 nodes", 16, 64, 4, 4, 2),
           ("schedules set, 4 nodes", 16, 64, 4, 4, 4),
           ("Kinetics-400 (141 x 1,703), 8 nodes", 141, 1703, 400, 1, 8),
           ("Kinetics-400, 256 nodes", 141, 1703, 400, 1, 256),
           ("Kinetics-400 as 10-clip videos, 256 nodes", 141, 1703, 400, 10, 256)]


def layout_labels(order: str, n: int, classes: int, per_video: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` labels (balanced classes, ``per_video`` clips of a video together where the order keeps them)."""
    videos = np.arange(-(-n // per_video)) % classes
    if order == "hashed":
        return rng.permutation(np.repeat(videos, per_video)[:n])
    if order == "videos":
        return np.repeat(rng.permutation(videos), per_video)[:n]
    if order == "halves":
        labels = np.repeat(videos, per_video)[:n]
        first = labels < classes // 2
        return np.concatenate([rng.permutation(labels[first]), rng.permutation(labels[~first])])
    return np.sort(np.repeat(videos, per_video)[:n])


def judge(labels: np.ndarray, shards: int, per_shard: int, nodes: int, seed: int) -> classmix.Mix:
    """The guard's verdict on ``labels`` in shards of ``per_shard``, shared out with the run seed ``seed``."""
    per_shard_labels = [labels[i * per_shard:(i + 1) * per_shard] for i in range(shards)]
    shares = partition.assign([len(x) for x in per_shard_labels], nodes, seed)
    return classmix.class_mix(per_shard_labels, shares, seed)


# --power's grid: (shards, clips per shard), each with every class count that leaves a class 2 clips or more
POWER_LAYOUTS = [(12, 5), (12, 64), (48, 16), (141, 64)]
POWER_CLASSES = [2, 4, 10, 40, 400]
POWER_NODES = [2, 4, 8]


def power(orders: int) -> None:
    """The false-pass and false-refusal rates over ``POWER_*`` (module docstring)."""
    print(f"{orders} run seeds a cell; sorted: class by class; hashed: a random order (another at each "
          f"seed)\n")
    print("nodes | shards x clips | classes | sorted passed, node test alone | sorted passed, node and "
          "stored-order tests | sorted passed by the node test alone with its worst node TV >= 1/6 (2:1 "
          "where 1:1 is due) | hashed refused, node alone | hashed refused, both")
    totals = np.zeros(5, dtype=int)
    cells = 0
    for nodes in POWER_NODES:
        for shards, per_shard in POWER_LAYOUTS:
            n = shards * per_shard
            for classes in (c for c in POWER_CLASSES if 2 * c <= n):
                rows = np.zeros(5, dtype=int)
                for seed in range(orders):
                    sorted_mix = judge(layout_labels("sorted", n, classes, 1, np.random.default_rng(seed)),
                                       shards, per_shard, nodes, seed)
                    hashed = judge(layout_labels("hashed", n, classes, 1, np.random.default_rng(seed)),
                                   shards, per_shard, nodes, seed)
                    # 2:1 where 1:1 is due
                    skewed = sorted_mix.shares_mixed and sorted_mix.worst >= 1 / 6 - 1e-9
                    rows += [sorted_mix.shares_mixed, sorted_mix.mixed, skewed, not hashed.shares_mixed,
                             not hashed.mixed]
                totals += rows
                cells += 1
                print(f"{nodes} | {shards} x {per_shard} | {classes} | "
                      + " | ".join(f"{r}/{orders}" for r in rows))
    print(f"\nall {cells} cells ({cells * orders} seeds each column): " + " | ".join(f"{t}" for t in totals))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--orders", type=int, default=100, help="run seeds (and random orders) per row")
    p.add_argument("--large-orders", type=int, default=10, help="the same for the Kinetics-sized rows "
                   "(240,123 clips)")
    p.add_argument("--power", action="store_true", help="the false-pass and false-refusal rates instead")
    args = p.parse_args()
    if args.power:
        power(args.orders)
        return
    print(f"node shares differ in classes (node-affine refused) when the worst node's total variation (TV) "
          f"exceeds a random order's by more than {classmix.MARGIN} and {classmix.SPREADS} of its standard "
          f"deviations; {args.orders} run seeds per row ({args.large_orders} for Kinetics' sizes)\n")
    print("layout | order | worst node's TV: median, largest | beyond a random order's: median, largest | "
          "limit (smallest) | refused at | classes in a node's share")
    for name, shards, per_shard, classes, per_video, nodes in LAYOUTS:
        n = shards * per_shard
        seeds = range(args.orders if n < 100_000 else args.large_orders)
        for order in ("hashed", "videos", "halves", "sorted"):
            if order == "videos" and per_video == 1:
                continue
            mixes = [judge(layout_labels(order, n, classes, per_video, np.random.default_rng(s)), shards,
                           per_shard, nodes, s) for s in seeds]
            excess = [m.worst - m.shuffled for m in mixes]
            print(f"{name} | {order} | {statistics.median(m.worst for m in mixes):.3f}, "
                  f"{max(m.worst for m in mixes):.3f} | {statistics.median(excess):+.3f}, {max(excess):+.3f} "
                  f"| {min(m.limit - m.shuffled for m in mixes):.3f} | "
                  f"{sum(not m.mixed for m in mixes)}/{len(mixes)} seeds | "
                  f"{min(min(m.node_classes) for m in mixes)}-{max(max(m.node_classes) for m in mixes)}")


if __name__ == "__main__":
    main()
