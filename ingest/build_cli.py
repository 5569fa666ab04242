"""Decode Kinetics videos into pre-sampled T-frame JPEG clips in WebDataset shards, on Ray (or, for a
small build on this machine, in worker processes without it: ``ingest.tasks.runtime``).

Reads SRC in the class-folder layout (SRC/{train,val,test}/<label>/<id>.<ext>), the CVDF
layout (flat SRC/<split>/<youtube_id>_<start>_<end>.mp4 with SRC/annotations/<split>.csv), or
UCF101 or HMDB51 as distributed, with their split files (``ingest.sources``), and
writes OUT/<split>/<split>-NNNNNN.tar, OUT/manifest.json, OUT/classes.txt and the error ledger
OUT/errors.jsonl. Bad videos, and videos of the train and val splits without a label, are
recorded in the ledger and skipped; videos used with a caveat (a still image, fewer frames than
--frames, smaller than --short-side, no motion vectors for --motion mv) and annotated videos that
are not there are ledger warnings. The command exits non-zero only when the failed fraction
exceeds --max-error-fraction (saying whether the set is usable, and how to accept it). OUT must be
new, empty, or a set or killed build of this project's; --force builds into another directory.
A killed build resumes when rerun, with any batching, worker count or timeout: each video's
staged samples are found by what decides their bytes. A finished set at OUT built with other
options, or one a catalog records there, is replaced only with --force.
"""
from __future__ import annotations

import argparse
import math
import sys

from shards.base.commands import comma_list, number_in_range, positive_int
from shards.base.errors import CommandError, UsageError
from shards.format.manifest import LEDGER_NAME
from shards.io import storage

from . import registry
from .bounds import flag, size_flag
from .build import build
from .clips import ClipConfig
from .content_digests import FINGERPRINTS, default_cache
from .decode import DECODERS
from .decode.motion import MOTIONS
from .sources import SPLIT_SETS, SPLITS
from .tasks import ray_address


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="source tree (local path or fsspec URL)")
    p.add_argument("--out", required=True, help="output directory (local path or fsspec URL)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="parallel decode tasks (default: all CPUs of the Ray cluster, or of this machine)")
    p.add_argument("--address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379; 'auto': the one RAY_ADDRESS names or "
                        "'ray start' joined on this node) instead of running the tasks on this machine: in "
                        "worker processes without Ray, or with more than 1000 videos on a local Ray started "
                        "for the build; an address nothing answers at is refused at once")
    p.add_argument("--frames", type=flag("frames"), default=8,
                   help="frames per clip (TSN/TSM segments T), 1 to 64")
    p.add_argument("--refuse-short-videos", action="store_true",
                   help="a video of fewer frames than --frames (a still image renamed .mp4, a 1-frame video) "
                        "fails, recorded in the ledger; without it, it is stored with frames repeated and a "
                        "ledger warning")
    p.add_argument("--clips-per-video", type=flag("clips_per_video"), default=1,
                   help="independently sampled training clips stored per training video, 1 to 64")
    p.add_argument("--eval-clips", type=flag("eval_clips"), default=1,
                   help="clips per val/test video, at evenly spread offsets (1 = segment centres), 1 to 64")
    p.add_argument("--short-side", type=flag("short_side"), default=256,
                   help="resize frames so the short side is this many pixels, 16 to 2048; a smaller video is "
                        "stored at its own size (never upscaled), with a ledger warning")
    p.add_argument("--quality", type=flag("quality"), default=90, help="JPEG quality, 1 to 100")
    p.add_argument("--restart-interval", type=flag("restart_interval"), default=1, metavar="MCUS",
                   help="JPEG restart marker every MCUS macroblocks of 16x16 pixels (rounded down to tile "
                        "the rows), so the loader decodes only the intervals under its crop; 0: none "
                        "(smaller files)")
    p.add_argument("--seed", type=flag("seed"), default=0,
                   help="seeds frame sampling and sample order (0 to 2**63-1)")
    p.add_argument("--decoder", choices=DECODERS, default="pyav",
                   help="pyav: decode in-process, only the packets the kept frames need (what PyAV cannot "
                        "open goes to the ffmpeg command line); ffmpeg: the command line for every video")
    p.add_argument("--motion", choices=MOTIONS, default="none",
                   help="also store each frame's motion from the frame before it, NN.<motion>.png on a grid "
                        "of 8x8 pixels (shards.format.motionfield): mv: the codec's motion vectors from the "
                        "same decode (needs --decoder pyav; H.264, MPEG-4 Part 2, MPEG-1/2 and H.263 export "
                        "them, VP8, VP9, HEVC and AV1 do not: each such video is a ledger warning); flow: "
                        "optical flow (OpenCV DIS; decodes the frame before each)")
    p.add_argument("--shard-size", type=size_flag("shard_size"), default="256MB",
                   help="cut shards at this many bytes (e.g. 64MB, 1GiB; 1MB to 64GiB)")
    p.add_argument("--shard-samples", type=flag("shard_samples"), default=None,
                   help="cut shards at this many samples instead (up to 1,000,000)")
    p.add_argument("--max-error-fraction", type=number_in_range(float, 0, 1), default=0.05,
                   help="exit non-zero if more than this fraction of the videos fail (the good ones are "
                        "written all the same)")
    p.add_argument("--splits", type=comma_list(SPLITS), default="train,val,test",
                   help="comma-separated splits to build")
    p.add_argument("--split-set", type=int, choices=SPLIT_SETS, default=1,
                   help="UCF101 and HMDB51: which official train/test split (its test list becomes the val "
                        "split)")
    p.add_argument("--videos-per-task", type=flag("videos_per_task"), default=None,
                   help="videos decoded per task (default: sized from the videos' bytes and the workers, at "
                        "most 8 videos each, shrinking to single videos towards the end so that no worker "
                        "idles)")
    p.add_argument("--ffmpeg-threads", type=flag("ffmpeg_threads"), default=1,
                   help="decoder threads per video, 1 to 16")
    p.add_argument("--timeout", type=flag("timeout", float), default=600,
                   help="seconds one video may take, download, probe and decode included, before it is "
                        "abandoned and recorded in the ledger (1 to 3600)")
    p.add_argument("--keep-staging", action="store_true", help="keep OUT/.staging after a successful build")
    p.add_argument("--catalog",
                   help="register the build in this dataset catalog (a SQLite file, or a postgresql:// URL); "
                        "a set with the same inputs and output options already built anywhere is reused, "
                        "nothing decoded")
    p.add_argument("--name", help="catalog name of the set (default: the last part of --out)")
    p.add_argument("--fingerprint", choices=FINGERPRINTS, default="stat",
                   help="what identifies the inputs, for the catalog, a finished --out and staged videos: "
                        "stat: each one's path and size, and for the catalog its modification time (a video "
                        "rewritten with the same size, its mtime kept, passes for the old one); content: the "
                        "SHA-256 of its bytes, read by the Ray workers (a corrected video is new, the same "
                        "videos under another source directory are the same)")
    p.add_argument("--hash-cache", metavar="FILE", default=default_cache(),
                   help="SQLite file of content digests by path, size, mtime, ctime and inode, so a rebuild "
                        "does not reread unchanged inputs (keep it on a local disk)")
    p.add_argument("--force", action="store_true",
                   help="rebuild even if the same build is already finished; replace a set at --out built "
                        "with other options, or one a catalog records there (that record is marked "
                        "replaced), or one whose files changed since the catalog registered it")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = ClipConfig(frames=args.frames, clips_per_video=args.clips_per_video, eval_clips=args.eval_clips,
                         short_side=args.short_side, quality=args.quality,
                         restart_interval=args.restart_interval, seed=args.seed, decoder=args.decoder,
                         motion=args.motion, refuse_short=args.refuse_short_videos)
    except ValueError as e:
        raise UsageError(str(e)) from None
    kwargs = dict(workers=args.workers, address=args.address, shard_samples=args.shard_samples,
                  shard_size=None if args.shard_samples else args.shard_size,
                  splits=args.splits, videos_per_task=args.videos_per_task, threads=args.ffmpeg_threads,
                  timeout=args.timeout, keep_staging=args.keep_staging, force=args.force,
                  fingerprint=args.fingerprint, hash_cache=args.hash_cache, split_set=args.split_set)
    if args.address:  # before anything else: ray.init would retry a wrong address for minutes
        try:
            ray_address.check_reachable(args.address)
        except ConnectionError as e:
            raise CommandError(f"--address {args.address}: {e}; "
                               "is `ray start --head` running there?") from None
    location = args.out
    if args.catalog:
        summary, record = registry.build(args.catalog, args.src, args.out, cfg, name=args.name,
                                         max_error_fraction=args.max_error_fraction, **kwargs)
        if record.state == "ready":
            print(("reused " if summary.reused else "registered ") + registry.where(record))
        asked = args.name or registry.default_name(args.out)
        if asked and record.name == f"{asked}-{record.id[:8]}":
            print(f"named {record.name}: the name {asked!r} belongs to another dataset (--name chooses one)")
        location = record.location
    else:  # a set the default catalog records at --out is replaced only with --force, and marked so
        summary = build(args.src, args.out, cfg, replacing=registry.guard(args.out, args.force), **kwargs)
    print(("up to date: " if summary.reused else "done: ") + summary.line())
    fraction = summary.failed / max(1, summary.videos)
    if fraction > args.max_error_fraction:
        outcome = " so the set is recorded failed" if args.catalog else ""
        if summary.clips:  # every good video's clips are written: a set of fewer videos, nothing wrong in it
            accept = math.ceil(fraction * 100) / 100
            outcome += (f"; the set at {location} holds every other video's clips and is usable: the same "
                        f"command with --max-error-fraction {accept:g} accepts it, decoding nothing again")
        print(f"ingest build: error: {summary.failed} of {summary.videos} videos failed ({fraction:.1%} > "
              f"--max-error-fraction {args.max_error_fraction:.1%}){outcome}; "
              f"see {storage.join(location, LEDGER_NAME)}", file=sys.stderr)
        return 1
    return 0
