"""Decode Kinetics videos into pre-sampled T-frame JPEG clips in WebDataset shards, on Ray.

Reads SRC in the class-folder layout (SRC/{train,val,test}/<label>/<id>.<ext>) or the CVDF
layout (flat SRC/<split>/<youtube_id>_<start>_<end>.mp4 with SRC/annotations/<split>.csv) and
writes OUT/<split>/<split>-NNNNNN.tar, OUT/manifest.json, OUT/classes.txt and the error ledger
OUT/errors.jsonl. Bad videos, and videos of the train and val splits without a label, are
recorded in the ledger and skipped; the command exits non-zero only when the failed fraction
exceeds --max-error-fraction. A killed build resumes when rerun, with any batching, worker count
or timeout: each video's staged samples are found by what decides their bytes.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import ray
from fsspec.core import url_to_fs
from tqdm import tqdm

from shards import ordering, packing, storage
from shards.manifest import MANIFEST_NAME, Manifest, ShardInfo, SplitInfo

from . import ray_runtime, staging
from .clips import DECODERS, ClipConfig
from .sources import LABELED_SPLITS, SPLITS, Source, Video, discover

log = logging.getLogger("ingest.build")
LEDGER = "errors.jsonl"
STAGING = ".staging"
_TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{8}$")  # shards.storage's atomic writes before their rename
_SHARD = re.compile(rf"({'|'.join(SPLITS)})/\1-\d{{6}}\.tar")  # packing.shard_name


@dataclass
class Summary:
    videos: int = 0
    clips: int = 0
    failed: int = 0
    bytes: int = 0
    shards: int = 0
    seconds: float = 0.0
    pack_seconds: float = 0.0  # of ``seconds``: cutting staged samples into shards
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
    p.add_argument("--restart-interval", type=int, default=1, metavar="MCUS",
                   help="JPEG restart marker every MCUS macroblocks of 16x16 pixels (rounded down to tile the "
                        "rows), so the loader decodes only the intervals under its crop; 0: none (smaller files)")
    p.add_argument("--seed", type=int, default=0, help="seeds frame sampling and sample order")
    p.add_argument("--decoder", choices=DECODERS, default="pyav",
                   help="pyav: decode in-process, only the packets the kept frames need (what PyAV cannot "
                        "open goes to the ffmpeg command line); ffmpeg: the command line for every video")
    p.add_argument("--shard-size", default="256MB", help="cut shards at this many bytes (e.g. 64MB, 1GiB)")
    p.add_argument("--shard-samples", type=int, default=None, help="cut shards at this many samples instead")
    p.add_argument("--max-error-fraction", type=float, default=0.05,
                   help="exit non-zero if more than this fraction of the videos fail (the good ones are "
                        "written all the same)")
    p.add_argument("--splits", default="train,val,test", help="comma-separated splits to build")
    p.add_argument("--videos-per-task", type=int, default=8, help="videos decoded per Ray task")
    p.add_argument("--ffmpeg-threads", type=int, default=1, help="decoder threads per video")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds one video may take, download, probe and decode included, before it is "
                        "abandoned and recorded in the ledger")
    p.add_argument("--keep-staging", action="store_true", help="keep OUT/.staging after a successful build")
    p.add_argument("--catalog", help="register the build in this dataset catalog (SQLite file); a set with the same "
                                     "inputs and output options already built anywhere is reused, nothing decoded")
    p.add_argument("--name", help="catalog name of the set (default: the last part of --out)")
    p.add_argument("--force", action="store_true", help="rebuild even if the same build is already finished")


def run(args: argparse.Namespace) -> int:
    cfg = ClipConfig(frames=args.frames, clips_per_video=args.clips_per_video, eval_clips=args.eval_clips,
                     short_side=args.short_side, quality=args.quality,
                     restart_interval=args.restart_interval, seed=args.seed, decoder=args.decoder)
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
        _tidy(out, existing, keep_staging)
        return _summarise_existing(existing, summary)

    stage = storage.join(out, STAGING)
    unlabeled = [v for v in videos if v.split in LABELED_SPLITS and v.label is None]
    videos = [v for v in videos if not (v.split in LABELED_SPLITS and v.label is None)]
    log.info("%s: %s layout, %d videos (%s), %d classes; staging in %s", src, source.layout, len(videos),
             ", ".join(f"{s}: {n}" for s, n in sorted(Counter(v.split for v in videos).items())),
             len(source.classes), stage)
    parallel = ray_runtime.start(address, workers)
    report = progress or (lambda state: None)
    entries = _decode_all(stage, videos, source, cfg, parallel, videos_per_task, threads, timeout,
                          summary.tasks_per_node, report)

    errors = sorted([_unlabeled(v, source.layout) for v in unlabeled] + [e["error"] for e in entries if e["error"]],
                    key=lambda e: e["path"])
    manifest = Manifest(classes=source.classes, splits={}, config=config, fingerprint=fingerprint)
    packing_started = time.time()
    for split in config["splits"]:
        split_entries = [e for e in entries if e["split"] == split]
        shards = _pack_split(out, stage, split, split_entries, cfg.seed, shard_size, shard_samples,
                             summary.tasks_per_node,
                             lambda n: report({"videos_done": len(videos), "videos_total": len(videos),
                                               "failed": len(errors), "shards_written": n + sum(
                                                   len(s.shards) for s in manifest.splits.values())}))
        manifest.splits[split] = SplitInfo(shards=shards,
                                           num_failed=sum(e["split"] == split for e in errors))
    summary.pack_seconds = time.time() - packing_started
    storage.atomic_write(storage.join(out, LEDGER),
                         b"".join(json.dumps(e, sort_keys=True).encode() + b"\n" for e in errors))
    storage.atomic_write(storage.join(out, "classes.txt"), "".join(c + "\n" for c in source.classes).encode())
    manifest.save(out)
    _tidy(out, manifest, keep_staging)

    summary.failed = len(errors)
    summary.reasons = Counter(e["reason"].split(":")[0] for e in errors)
    summary.clips = sum(s.num_samples for s in manifest.splits.values())
    summary.bytes = sum(s.num_bytes for s in manifest.splits.values())
    summary.shards = sum(len(s.shards) for s in manifest.splits.values())
    summary.seconds = time.time() - t0
    for e in errors:
        log.warning("failed: %s: %s%s", e["path"], e["reason"], f" ({e['ffmpeg']})" if e["ffmpeg"] else "")
    return summary


def _unlabeled(video: Video, layout: str) -> dict:
    """The ledger line of a video in a labeled split that has no label: it never reaches a shard,
    where it would stop training at the first batch that holds it."""
    where = (f"no label in annotations/{video.split}.csv" if layout == "cvdf"
             else f"not inside a class folder ({video.split}/<label>/...)")
    return {"path": video.relpath, "split": video.split, "reason": f"unlabeled: {where}", "ffmpeg": ""}


def _tidy(out: str, manifest: Manifest, keep_staging: bool) -> None:
    """Leave only the finished set: staging removed (unless kept), and no temporary file or shard
    of a killed or earlier build left beside the shards the manifest lists."""
    fs, root = url_to_fs(out)
    root = root.rstrip("/")
    if not keep_staging and fs.exists(f"{root}/{STAGING}"):
        fs.rm(f"{root}/{STAGING}", recursive=True)
    listed = {s.name for split in manifest.splits.values() for s in split.shards}
    for path in fs.find(root):
        rel = path.rstrip("/")[len(root) + 1:]
        if _TEMPORARY.search(rel) or (_SHARD.fullmatch(rel) and rel not in listed):
            fs.rm(path)


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


def _decode_all(stage, videos, source: Source, cfg, parallel, videos_per_task, threads, timeout,
                nodes: Counter, report) -> list[dict]:
    """Every video's staged entry: reused when staging already holds it, else decoded by Ray tasks
    in fixed batches of the remaining videos (path order). ``nodes`` counts tasks per Ray node;
    ``report`` gets the counts as work is done."""
    index = {c: i for i, c in enumerate(source.classes)}
    labels = {v.relpath: index[v.label] if v.label is not None else -1 for v in videos}
    keys = {v.relpath: staging.video_key(v, labels[v.relpath], cfg) for v in videos}
    done = staging.staged(stage)
    entries = [done[keys[v.relpath]] for v in videos if keys[v.relpath] in done]
    todo = sorted((v for v in videos if keys[v.relpath] not in done), key=lambda v: v.relpath)
    if entries:
        log.info("%d of %d videos already staged by an earlier run", len(entries), len(videos))
    batches = [todo[i:i + videos_per_task] for i in range(0, len(todo), videos_per_task)]
    task = ray_runtime.task(staging.decode_batch)
    pending = {}
    failed = sum(1 for e in entries if e["error"])
    with tqdm(total=len(videos), initial=len(entries), unit="video", desc="decode", smoothing=0.1,
              mininterval=1.0) as bar:
        while batches or pending:
            while batches and len(pending) < 2 * parallel:
                vs = batches.pop(0)
                ref = task(stage, vs, [keys[v.relpath] for v in vs], [labels[v.relpath] for v in vs],
                           cfg, threads, timeout)
                pending[ref] = len(vs)
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                bar.update(pending.pop(ref))
                result, node = ray.get(ref)
                nodes[node] += 1
                entries += [{**e, "batch": result["batch"]} for e in result["videos"]]
                failed += sum(1 for e in result["videos"] if e["error"])
                bar.set_postfix(failed=failed, refresh=False)
                report({"videos_done": bar.n, "videos_total": len(videos), "failed": failed, "shards_written": 0})
    return sorted(entries, key=lambda e: e["path"])


def _pack_split(out, stage, split, entries, seed, shard_size, shard_samples, nodes: Counter,
                report) -> list[ShardInfo]:
    samples = {s["key"]: (s["key"], s["label"], e["batch"], s["offset"], s["length"])
               for e in entries for s in e["samples"]}
    order = [samples[k] for k in ordering.shuffled(samples, seed)]
    cuts = packing.cut([p[4] for p in order], shard_size, shard_samples)
    task = ray_runtime.task(staging.pack_shard)
    refs = [task(out, packing.shard_name(split, i), stage, order[r.start:r.stop])
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
