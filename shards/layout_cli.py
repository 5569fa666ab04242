"""Recommend a shard layout and predict metadata operations per epoch, 1 to N ranks.

Give a manifest (its split's clip count and bytes are used) or dataset totals. The table
compares this layout with frame folders and one file per video; see ``shards.layout``.
"""
from __future__ import annotations

import argparse
import json

from .errors import UsageError
from .layout import MB, Totals, format_plan, plan
from .manifest import Manifest
from .packing import parse_size

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
    p.add_argument("--world-sizes", default=",".join(map(str, DEFAULT_WORLD_SIZES)),
                   help="comma-separated world sizes for the table")
    p.add_argument("--target-size", default="256MB", help="shard size to aim for")
    p.add_argument("--num-shards", type=int, help="plan this shard count instead of recommending one")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.manifest:
        m = Manifest.load(args.manifest)
        if args.split not in m.splits:
            raise UsageError(f"{args.manifest}: no split {args.split!r} (it has {', '.join(m.splits) or 'none'})")
        split = m.splits[args.split]
        totals = Totals(split.num_samples, split.num_bytes / max(1, split.num_samples),
                        m.config.get("clip", {}).get("frames", args.frames))  # as ingest writes it
    elif args.clips:
        totals = Totals(args.clips, parse_size(args.clip_size), args.frames)
    else:
        raise SystemExit("shards plan: give a manifest or --clips")
    worlds = [int(w) for w in args.world_sizes.split(",") if int(w) <= args.max_world_size]
    p = plan(totals, args.max_world_size, args.workers, args.batch_size, worlds,
             parse_size(args.target_size) or 256 * MB, args.num_shards)
    print(json.dumps(p, sort_keys=True) if args.json else format_plan(p))
    return 0
