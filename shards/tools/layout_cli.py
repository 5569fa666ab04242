"""Recommend a shard layout and predict metadata operations per epoch, 1 to N ranks.

Give a built set (its split's own layout is tabled first, then the recommendation for its clip
count and bytes) or dataset totals. Each table compares the layout with frame folders and one
file per video, a row per world size (``--world-sizes``; by default 1 to ``--max-world-size``);
see ``shards.plan.layout``.
"""
from __future__ import annotations

import argparse
import json

from ..base.errors import UsageError
from ..base.units import parse_size
from ..format.manifest import Manifest
from ..plan.layout import MB, Totals, format_plan, plan

DEFAULT_WORLD_SIZES = [1, 8, 64, 256, 512, 1024, 1536, 2048, 4096, 6144]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("manifest", nargs="?", help="shard-set directory or manifest URL (else give --clips)")
    p.add_argument("--split", default="train", help="split of the manifest to plan for")
    p.add_argument("--clips", type=int, help="clips in the split (without a manifest)")
    p.add_argument("--clip-size", default="150kB", help="mean bytes per clip (without a manifest)")
    p.add_argument("--frames", type=int, default=8, help="frames per clip")
    p.add_argument("--max-world-size", type=int, default=6144, help="largest number of ranks to serve")
    p.add_argument("--workers", type=int, default=8, help="loader workers per rank")
    p.add_argument("--batch-size", type=int, default=8, help="clips per rank per step")
    p.add_argument("--world-sizes", type=world_sizes,
                   help="comma-separated world sizes, a table row each (default: "
                        f"{','.join(map(str, DEFAULT_WORLD_SIZES))}, up to --max-world-size, and it)")
    p.add_argument("--target-size", default="256MB", help="shard size to aim for")
    p.add_argument("--num-shards", type=int, help="plan this shard count instead of recommending one")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def world_sizes(text: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64]: whole numbers of ranks, 1 or more."""
    try:
        sizes = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give whole numbers of ranks separated by commas") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give world sizes of 1 rank or more")
    return sizes


def run(args: argparse.Namespace) -> int:
    shard_sizes = None
    if args.manifest:
        m = Manifest.load(args.manifest)
        if args.split not in m.splits:
            raise UsageError(f"{args.manifest}: no split {args.split!r} "
                             f"(it has {', '.join(m.splits) or 'none'})")
        split = m.splits[args.split]
        totals = Totals(split.num_samples, split.num_bytes / max(1, split.num_samples),
                        m.config.get("clip", {}).get("frames", args.frames))  # as ingest writes it
        shard_sizes = [s.num_samples for s in split.shards if s.num_samples]
    elif args.clips:
        totals = Totals(args.clips, parse_size(args.clip_size), args.frames)
    else:
        raise SystemExit("shards plan: give a manifest or --clips")
    worlds = args.world_sizes or ([w for w in DEFAULT_WORLD_SIZES if w < args.max_world_size]
                                  + [args.max_world_size])
    layout = dict(max_world=args.max_world_size, workers=args.workers, batch_size=args.batch_size,
                  world_sizes=worlds)
    p = plan(totals, target_bytes=parse_size(args.target_size) or 256 * MB, num_shards=args.num_shards,
             **layout)
    own = plan(totals, shard_sizes=shard_sizes, **layout) if shard_sizes else None
    print(json.dumps({**p, "set": own}, sort_keys=True) if args.json else format_plan(p, own))
    return 0
