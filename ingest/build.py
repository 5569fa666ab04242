"""Decode Kinetics videos into pre-sampled T-frame JPEG clips in WebDataset shards, on Ray.

Reads SRC in the class-folder layout (SRC/{train,val,test}/<label>/<id>.<ext>) or the CVDF
layout (flat SRC/<split>/<youtube_id>_<start>_<end>.mp4 with SRC/annotations/<split>.csv) and
writes OUT/<split>/<split>-NNNNNN.tar, OUT/manifest.json, OUT/classes.txt and the error ledger
OUT/errors.jsonl. Bad videos are recorded in the ledger and skipped; the command exits non-zero
only when the failed fraction exceeds --max-error-fraction. A killed build resumes when rerun.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import ray
from fsspec.core import url_to_fs
from tqdm import tqdm

from shards import ordering, packing, storage
from shards.manifest import MANIFEST_NAME, Manifest, ShardInfo, SplitInfo, digest

from . import ray_runtime, staging
from .clips import DECODE_MODES, ClipConfig
from .sources import Source, Video, discover

log = logging.getLogger("ingest.build")
LEDGER = "errors.jsonl"


@dataclass
class Summary:
    videos: int = 0
    clips: int = 0
    failed: int = 0
    bytes: int = 0
    shards: int = 0
    seconds: float = 0.0
    reasons: Counter = field(default_factory=Counter)
    missing: int = 0  # annotated in the CSVs but not downloaded
    reused: bool = False
    tasks_per_node: Counter = field(default_factory=Counter)  # Ray node id -> decode and pack tasks run

    def line(self) -> str:
        rate = self.videos / self.seconds if self.seconds else 0.0
        text = (f"{self.videos} videos in, {self.clips} clips out, {self.failed} failed, "
                f"{self.bytes / 1e6:.1f} MB in {self.shards} shards, {self.seconds:.1f} s "
                f"({rate:.1f} videos/s)")
        if self.missing:
            text += f"; {self.missing} annotated videos not found"
        if self.reasons:
            text += "; failures: " + ", ".join(f"{n} x {r}" for r, n in self.reasons.most_common(5))
        if len(self.tasks_per_node) > 1:
            text += f"; tasks on {len(self.tasks_per_node)} nodes: " + ", ".join(
                f"{node[:12]} {n}" for node, n in sorted(self.tasks_per_node.items()))
        return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="source tree (local path or fsspec URL)")
    p.add_argument("--out", required=True, help="output directory (local path or fsspec URL)")
    p.add_argument("--workers", type=int, default=None,
                   help="parallel decode tasks (default: all CPUs of the Ray cluster)")
    p.add_argument("--address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379; 'auto': the one RAY_ADDRESS names or 'ray start' joined on this node) instead of starting a local Ray")
    p.add_argument("--frames", type=int, default=8, help="frames per clip (TSN/TSM segments T)")
    p.add_argument("--clips-per-video", type=int, default=1,
                   help="independently sampled training clips stored per training video")
    p.add_argument("--eval-clips", type=int, default=1,
                   help="clips per val/test video, at evenly spread offsets (1 = segment centres)")
    p.add_argument("--short-side", type=int, default=256, help="resize frames so the short side is this")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality")
    p.add_argument("--seed", type=int, default=0, help="seeds frame sampling and sample order")
    p.add_argument("--decode", choices=DECODE_MODES, default="all",
                   help="all: decode every frame and sample exactly as TSN/TSM; refs: sample only reference "
                        "frames (each pick moves to the nearest one in its segment) and skip decoding the "
                        "others, faster than a full decode (H.264 MP4; other videos are decoded whole)")
    p.add_argument("--shard-size", default="256MB", help="cut shards at this many bytes (e.g. 64MB, 1GiB)")
    p.add_argument("--shard-samples", type=int, default=None, help="cut shards at this many samples instead")
    p.add_argument("--max-error-fraction", type=float, default=0.05,
                   help="exit non-zero if more than this fraction of the videos fail (the good ones are "
                        "written all the same)")
    p.add_argument("--splits", default="train,val,test", help="comma-separated splits to build")
    p.add_argument("--videos-per-task", type=int, default=8, help="videos decoded per Ray task")
    p.add_argument("--ffmpeg-threads", type=int, default=1, help="decoder threads per video")
    p.add_argument("--timeout", type=float, default=600, help="seconds before one ffmpeg call is abandoned")
    p.add_argument("--keep-staging", action="store_true", help="keep OUT/.staging after a successful build")
    p.add_argument("--catalog", help="register the build in this dataset catalog (SQLite file); a set with the same "
                                     "inputs and output options already built anywhere is reused, nothing decoded")
    p.add_argument("--name", help="catalog name of the set (default: the last part of --out)")
    p.add_argument("--force", action="store_true", help="rebuild even if the same build is already finished")


def run(args: argparse.Namespace) -> int:
    cfg = ClipConfig(frames=args.frames, clips_per_video=args.clips_per_video, eval_clips=args.eval_clips,
                     short_side=args.short_side, quality=args.quality, seed=args.seed, decode=args.decode)
    kwargs = dict(workers=args.workers, address=args.address, shard_samples=args.shard_samples,
                  shard_size=None if args.shard_samples else packing.parse_size(args.shard_size),
                  splits=args.splits.split(","), videos_per_task=args.videos_per_task, threads=args.ffmpeg_threads,
                  timeout=args.timeout, keep_staging=args.keep_staging, force=args.force)
    if args.catalog:
        from shards.catalog import CatalogError

        from . import registry
        try:
            summary, record = registry.build(args.catalog, args.src, args.out, cfg, name=args.name, **kwargs)
        except CatalogError as e:
            print(f"error: {e}")
            return 2
        print(("reused " if summary.reused else "registered ") + registry.where(record))
    else:
        summary = build(args.src, args.out, cfg, **kwargs)
    print(("up to date: " if summary.reused else "done: ") + summary.line())
    fraction = summary.failed / max(1, summary.videos)
    if fraction > args.max_error_fraction:
        print(f"error: {summary.failed} of {summary.videos} videos failed ({fraction:.1%} > "
              f"--max-error-fraction {args.max_error_fraction:.1%}); see {storage.join(args.out, LEDGER)}")
        return 1
    return 0


def build(src: str, out: str, cfg: ClipConfig = ClipConfig(), *, workers: int | None = None,
          address: str | None = None, shard_size: int | None = 256 * 10**6, shard_samples: int | None = None,
          splits=("train", "val", "test"), videos_per_task: int = 8, threads: int = 1,
          timeout: float = 600, keep_staging: bool = False, force: bool = False, source: Source | None = None,
          progress=None) -> Summary:
    """``source``: already discovered; ``progress``: called with a dict of counts as work is done."""
    t0 = time.time()
    source = source or discover(src)
    videos = [v for v in source.videos if v.split in splits]
    config = {"src": src, "layout": source.layout, "clip": cfg.as_dict(), "shard_size": shard_size,
              "shard_samples": shard_samples, "splits": sorted({v.split for v in videos})}
    fingerprint = source.fingerprint()
    summary = Summary(videos=len(videos), missing=sum(source.missing.values()))
    existing = _existing(out)
    if existing and existing.config == config and existing.fingerprint == fingerprint and not force:
        log.info("%s is already built from these inputs with this config", out)
        return _summarise_existing(existing, summary)

    stage = storage.join(out, ".staging", digest([cfg.as_dict(), fingerprint, source.classes]))
    log.info("%s: %s layout, %d videos (%s), %d classes; staging in %s", src, source.layout, len(videos),
             ", ".join(f"{s}: {n}" for s, n in sorted(Counter(v.split for v in videos).items())),
             len(source.classes), stage)
    parallel = ray_runtime.start(address, workers)
    report = progress or (lambda state: None)
    results = _decode_all(stage, videos, source, cfg, parallel, videos_per_task, threads, timeout,
                          summary.tasks_per_node, report)

    errors = sorted((e for r in results for e in r["errors"]), key=lambda e: e["path"])
    manifest = Manifest(classes=source.classes, splits={}, config=config, fingerprint=fingerprint)
    for split in config["splits"]:
        split_results = [r for r in results if r["batch"].startswith(f"{split}-")]
        shards = _pack_split(out, stage, split, split_results, cfg.seed, shard_size, shard_samples,
                             summary.tasks_per_node,
                             lambda n: report({"videos_done": len(videos), "videos_total": len(videos),
                                               "failed": len(errors), "shards_written": n + sum(
                                                   len(s.shards) for s in manifest.splits.values())}))
        manifest.splits[split] = SplitInfo(shards=shards,
                                           num_failed=sum(e["split"] == split for e in errors))
    storage.atomic_write(storage.join(out, LEDGER),
                         b"".join(json.dumps(e, sort_keys=True).encode() + b"\n" for e in errors))
    storage.atomic_write(storage.join(out, "classes.txt"), "".join(c + "\n" for c in source.classes).encode())
    manifest.save(out)
    if not keep_staging:
        fs, path = url_to_fs(storage.join(out, ".staging"))
        fs.rm(path, recursive=True)

    summary.failed = len(errors)
    summary.reasons = Counter(e["reason"].split(":")[0] for e in errors)
    summary.clips = sum(s.num_samples for s in manifest.splits.values())
    summary.bytes = sum(s.num_bytes for s in manifest.splits.values())
    summary.shards = sum(len(s.shards) for s in manifest.splits.values())
    summary.seconds = time.time() - t0
    for e in errors:
        log.warning("failed: %s: %s%s", e["path"], e["reason"], f" ({e['ffmpeg']})" if e["ffmpeg"] else "")
    return summary


def _existing(out: str) -> Manifest | None:
    if not storage.exists(storage.join(out, MANIFEST_NAME)):
        return None
    try:
        return Manifest.load(out)
    except (ValueError, KeyError, json.JSONDecodeError):
        return None


def _summarise_existing(m: Manifest, summary: Summary) -> Summary:
    summary.reused = True
    summary.failed = sum(s.num_failed for s in m.splits.values())
    summary.clips = sum(s.num_samples for s in m.splits.values())
    summary.bytes = sum(s.num_bytes for s in m.splits.values())
    summary.shards = sum(len(s.shards) for s in m.splits.values())
    return summary


def _batches(videos: list[Video], size: int) -> list[tuple[str, list[Video]]]:
    """Fixed batches per split in path order: the same whatever the worker count, so resumable."""
    by_split = defaultdict(list)
    for v in sorted(videos, key=lambda v: v.relpath):
        by_split[v.split].append(v)
    return [(f"{split}-{i // size:06d}", vs[i:i + size])
            for split, vs in sorted(by_split.items()) for i in range(0, len(vs), size)]


def _decode_all(stage, videos, source: Source, cfg, parallel, videos_per_task, threads, timeout,
                nodes: Counter, report) -> list[dict]:
    index = {c: i for i, c in enumerate(source.classes)}
    task = ray.remote(num_cpus=1, max_retries=2)(ray_runtime.on_node)
    pending, results = {}, []
    todo = _batches(videos, videos_per_task)
    failed = 0
    with tqdm(total=len(videos), unit="video", desc="decode", smoothing=0.1, mininterval=1.0) as bar:
        while todo or pending:
            while todo and len(pending) < 2 * parallel:
                batch_id, vs = todo.pop(0)
                labels = [index[v.label] if v.label is not None else -1 for v in vs]
                pending[task.remote(staging.decode_batch, stage, batch_id, vs, labels, cfg, threads,
                                    timeout)] = len(vs)
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                bar.update(pending.pop(ref))
                result, node = ray.get(ref)
                nodes[node] += 1
                results.append(result)
                failed += len(result["errors"])
                bar.set_postfix(failed=failed, refresh=False)
                report({"videos_done": bar.n, "videos_total": len(videos), "failed": failed, "shards_written": 0})
    return sorted(results, key=lambda r: r["batch"])


def _pack_split(out, stage, split, results, seed, shard_size, shard_samples, nodes: Counter,
                report) -> list[ShardInfo]:
    samples = {s["key"]: (s["key"], s["label"], r["batch"], s["offset"], s["length"])
               for r in results for s in r["samples"]}
    order = [samples[k] for k in ordering.shuffled(samples, seed)]
    cuts = packing.cut([p[4] for p in order], shard_size, shard_samples)
    task = ray.remote(num_cpus=1, max_retries=2)(ray_runtime.on_node)
    refs = [task.remote(staging.pack_shard, out, packing.shard_name(split, i), stage, order[r.start:r.stop])
            for i, r in enumerate(cuts)]
    infos = []
    with tqdm(total=len(refs), unit="shard", desc=f"pack {split}", mininterval=1.0) as bar:
        for ref in refs:
            info, node = ray.get(ref)
            nodes[node] += 1
            infos.append(ShardInfo(**info))
            bar.update()
            report(len(infos))
    log.info("%s: %d clips in %d shards", split, len(order), len(infos))
    return infos
