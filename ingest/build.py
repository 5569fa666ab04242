"""The build engine behind ``ingest build``: videos in, a finished shard set out, on Ray.

``build`` lists the inputs (``sources.discover``), plans batches of videos (``plan_batches``), has
tasks (on Ray, or in local processes for a small build: ``ingest.tasks.runtime``) decode them into
``OUT/.staging`` (``staging.decode_batch``) and cut the staged samples into shards in their final
order (``staging.pack_shard``), then writes the manifest, ``classes.txt`` and the error ledger. A
finished build with the same inputs and config is left as it is; a killed one resumes, reusing
every staged video. Stopped by Ctrl-C or a full disk (``_stopped``), it cancels its tasks in
flight, so that nothing is left half-written, and says in one line what is staged; a local ``OUT``
without room for the shards is refused before any is written. What ``OUT`` may hold, and which
finished set a build may replace (another one's options, another tool's files: ``--force``), is
``ingest.outdir``; one from other inputs with the same options is rebuilt, the caller's
``replacing`` hook asked first (the catalog's guard). The manifest records the source as an
absolute path (or a URL), and how ``--src`` was spelled does not make a finished build another
one. The command line is ``ingest.build_cli``; the catalog's wrapper around ``build`` is
``ingest.registry``.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from shards.base.errors import CommandError, Interrupted, NoSpace
from shards.base.progress import Progress
from shards.base.words import plural
from shards.format import ordering, packing
from shards.format.manifest import (
    CLASSES_NAME,
    LEDGER_NAME,
    STAGING_NAME,
    Manifest,
    ShardInfo,
    SplitInfo,
)
from shards.io import storage

from . import content_digests, outdir, staging
from .clips import ClipConfig
from .sources import LABELED_SPLITS, Missing, Source, Video, discover
from .tasks import runtime

log = logging.getLogger("ingest.build")
SHARE_DIVISOR = 2  # a decode task sized from the videos takes 1/(this x parallel tasks) of the bytes left
MAX_VIDEOS_PER_TASK = 8



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
    warnings: Counter = field(default_factory=Counter)  # videos used with a caveat, by its code
    missing: int = 0  # annotated in the CSVs but not downloaded
    ledger: str = ""  # where the failures, warnings and missing videos are listed
    reused: bool = False
    tasks_per_node: Counter = field(default_factory=Counter)  # Ray node id -> decode and pack tasks run

    def line(self) -> str:
        rate = self.videos / self.seconds if self.seconds else 0.0
        text = (f"{plural(self.videos, 'video')} in, {plural(self.clips, 'clip')} out, "
                f"{self.failed:,} failed, {self.bytes / 1e6:.1f} MB in {plural(self.shards, 'shard')}, "
                f"{self.seconds:.1f} s ({rate:.1f} videos/s)")
        if self.missing:
            text += f"; {plural(self.missing, 'annotated video')} not found"
        if self.reasons:
            text += "; failures: " + ", ".join(f"{n} x {r}" for r, n in self.reasons.most_common(5))
        if self.warnings:
            text += "; warnings: " + ", ".join(f"{n} x {r}" for r, n in self.warnings.most_common())
        if self.ledger and (self.missing or self.reasons or self.warnings):
            text += f" (each listed in {self.ledger})"
        if len(self.tasks_per_node) > 1:
            text += f"; tasks on {len(self.tasks_per_node)} nodes: " + ", ".join(
                f"{node[:12]} {n}" for node, n in sorted(self.tasks_per_node.items()))
        return text


def build(src: str, out: str, cfg: ClipConfig = ClipConfig(), *, workers: int | None = None,
          address: str | None = None, shard_size: int | None = 256 * 10**6, shard_samples: int | None = None,
          splits=("train", "val", "test"), videos_per_task: int | None = None, threads: int = 1,
          timeout: float = 600, keep_staging: bool = False, force: bool = False, fingerprint: str = "stat",
          hash_cache: str | None = None, split_set: int = 1, source: Source | None = None,
          progress=None, replacing: Callable[[Manifest], None] | None = None, runner: str = "auto",
          tasks: runtime.Tasks | None = None) -> Summary:
    """``videos_per_task``: None sizes the tasks from the videos and the workers (``plan_batches``);
    ``runner``: where the tasks run (``ingest.tasks.runtime.start``), unless ``tasks`` is a pool already
    started (``local_runtime.LocalTasks``, ``ray_runtime.RayTasks``: the build runs on it and leaves
    it running for the caller's next build); ``fingerprint``: what identifies the
    inputs, ``"stat"`` or ``"content"`` (their SHA-256, cached in ``hash_cache``; see
    ``ingest.content_digests``); ``split_set``: UCF101's or HMDB51's train/test split
    (``sources.discover``); ``source``: already discovered;
    ``progress``: called with a dict of counts as work is done; ``replacing``: called with the
    finished set at ``out`` before a build that differs from it replaces it (it may refuse by raising)."""
    t0 = time.time()
    # Ray workers, whose working directory is not ours, use them
    src, out = outdir.normalise(src), outdir.normalise(out)
    source = source or discover(src, split_set)
    videos = [v for v in source.videos if v.split in splits]
    options = outdir.byte_options(source.layout, cfg, shard_size, shard_samples,
                                  sorted({v.split for v in videos}))
    existing = outdir.refuse_other_options(out, options, force)  # before any work, Ray included
    outdir.prepare_out(out, force)
    config = {"src": src, **options}
    digests = None
    if fingerprint == "content":  # stat adds nothing: sets built before --fingerprint existed stay up to date
        pool = tasks if tasks is not None else runtime.start(address, workers, len(videos), runner)
        try:
            digests = content_digests.digests(videos, hash_cache, pool)
        finally:
            _close_own(pool, tasks)
        config["fingerprint"] = "content"
    inputs_id = source.fingerprint(digests)
    summary = Summary(videos=len(videos), missing=sum(m.split in splits for m in source.missing),
                      ledger=storage.join(out, LEDGER_NAME))
    same = (existing is not None and _sans_src(existing.config) == _sans_src(config)
            and existing.fingerprint == inputs_id)
    if same and not force:
        log.info("%s is already built from these inputs with this config", out)
        outdir.tidy(out, existing, keep_staging)
        return _summarise_existing(existing, summary)
    if existing and not same and replacing:
        replacing(existing)
    if existing:
        log.warning("%s holds a shard set built %s: replacing it", out,
                    "before (--force)" if same else "from other inputs or options")

    stage = storage.join(out, STAGING_NAME)
    unlabeled = [v for v in videos if v.split in LABELED_SPLITS and v.label is None]
    videos = [v for v in videos if not (v.split in LABELED_SPLITS and v.label is None)]
    log.info("%s: %s layout, %d videos (%s), %d classes; staging in %s", src, source.layout, len(videos),
             ", ".join(f"{s}: {n}" for s, n in sorted(Counter(v.split for v in videos).items())),
             len(source.classes), stage)
    pool = tasks if tasks is not None else runtime.start(address, workers, len(videos), runner)
    counts = {"videos_done": 0, "videos_total": len(videos), "shards_written": 0}

    def report(state: dict) -> None:
        counts.update(state)
        if progress:
            progress(state)

    try:
        entries = _decode_all(stage, videos, source, cfg, digests, pool, videos_per_task, threads, timeout,
                              summary.tasks_per_node, report)
        errors = sorted([_unlabeled(v, source.layout) for v in unlabeled]
                        + [e["error"] for e in entries if e["error"]], key=lambda e: e["path"])
        warnings = [w for e in entries if not e["error"] for w in e.get("warnings", ())] + [
            _not_found(m) for m in source.missing if m.split in splits]
        manifest = Manifest(classes=source.classes, splits={}, config=config, fingerprint=inputs_id)
        packing_started = time.time()
        plans = {split: _plan_shards(split, [e for e in entries if e["split"] == split], cfg.seed, shard_size,
                                     shard_samples) for split in config["splits"]}
        _check_room(out, plans)
        for split, planned in plans.items():
            shards = _pack_split(pool, out, stage, split, planned, summary.tasks_per_node,
                                 lambda n: report({"videos_done": len(videos), "videos_total": len(videos),
                                                   "failed": len(errors), "shards_written": n + sum(
                                                       len(s.shards) for s in manifest.splits.values())}))
            warned = dict(sorted(Counter(w["warning"] for w in warnings if w["split"] == split).items()))
            manifest.splits[split] = SplitInfo(shards=shards,
                                               num_failed=sum(e["split"] == split for e in errors),
                                               warnings=warned)
        summary.pack_seconds = time.time() - packing_started
        ledger = sorted(errors + warnings, key=_ledger_order)
        storage.atomic_write(storage.join(out, LEDGER_NAME),
                             b"".join(json.dumps(e, sort_keys=True).encode() + b"\n" for e in ledger))
        storage.atomic_write(storage.join(out, CLASSES_NAME),
                             "".join(c + "\n" for c in source.classes).encode())
        manifest.save(out)
    except (KeyboardInterrupt, NoSpace) as stop:
        raise _stopped(stop, stage, counts) from None
    finally:
        _close_own(pool, tasks)
    outdir.tidy(out, manifest, keep_staging)

    summary.failed = len(errors)
    summary.reasons = Counter(e["reason"].split(":")[0] for e in errors)
    summary.warnings = Counter(w["warning"] for w in warnings if w["warning"] != NOT_FOUND)
    summary.clips = sum(s.num_samples for s in manifest.splits.values())
    summary.bytes = sum(s.num_bytes for s in manifest.splits.values())
    summary.shards = sum(len(s.shards) for s in manifest.splits.values())
    summary.seconds = time.time() - t0
    for e in errors:
        log.warning("failed: %s: %s%s", e["path"], e["reason"], f" ({e['ffmpeg']})" if e["ffmpeg"] else "")
    for w in warnings:
        if w["warning"] != NOT_FOUND:  # those are many (5-10% of Kinetics): the summary counts them
            log.warning("warning: %s: %s: %s", w["path"], w["warning"], w["reason"])
    return summary


def _close_own(pool: runtime.Tasks, given: runtime.Tasks | None) -> None:
    """Close ``pool`` if the build started it (not the caller's ``given`` one)."""
    if pool is not given:
        pool.close()


def _stopped(stop: BaseException, stage: str, counts: dict) -> CommandError:
    """The one line of a build stopped by Ctrl-C or a full disk: what is kept, and that the same
    command continues from it. Staged batches are whole (each written under a temporary name, then
    renamed); the tasks in flight were cancelled or ran to their end, removing their temporary files."""
    done, total, shards = counts["videos_done"], counts["videos_total"], counts["shards_written"]
    if shards or (total and done == total):
        kept, rerun = (f"all {total} videos are staged in {stage}",
                       "packs them into shards again, decoding nothing")
    else:
        kept, rerun = f"{done} of {total} videos are staged in {stage}", "continues from them"
    if isinstance(stop, NoSpace):
        return NoSpace(f"{stop}; {kept}: once there is room, the same command {rerun}")
    return Interrupted(f"interrupted; {kept}: the same command {rerun}")


def _unlabeled(video: Video, layout: str) -> dict:
    """The ledger line of a video in a labeled split that has no label: it never reaches a shard,
    where it would stop training at the first batch that holds it."""
    where = (f"no label in annotations/{video.split}.csv" if layout == "cvdf"
             else f"not inside a class folder ({video.split}/<label>/...)")
    return staging.ledger_line(video, f"unlabeled: {where}")


NOT_FOUND = "not found"  # the warning of a video the source's lists name that is not there


def _not_found(missing: Missing) -> dict:
    return {"path": missing.path, "split": missing.split, "ffmpeg": "", "warning": NOT_FOUND,
            "reason": f"{missing.listed} names it, no file is there"}


def _ledger_order(line: dict) -> tuple:
    """The ledger's order: by path, a video's failure before its warnings."""
    return line["path"], "warning" in line, line.get("warning", "")


def _sans_src(config: dict) -> dict:
    """A manifest's config without where the inputs were: the same videos and options are the same
    build however ``--src`` was spelled (relative or absolute; the manifests of builds before
    sources were recorded absolute hold it as given)."""
    return {k: v for k, v in config.items() if k != "src"}


def _summarise_existing(m: Manifest, summary: Summary) -> Summary:
    summary.reused = True
    summary.failed = sum(s.num_failed for s in m.splits.values())
    summary.warnings = sum((Counter(s.warnings) for s in m.splits.values()), Counter())
    del summary.warnings[NOT_FOUND]
    summary.clips = sum(s.num_samples for s in m.splits.values())
    summary.bytes = sum(s.num_bytes for s in m.splits.values())
    summary.shards = sum(len(s.shards) for s in m.splits.values())
    return summary


def plan_batches(videos: list[Video], parallel: int, per_task: int | None = None) -> list[list[Video]]:
    """``videos`` (in path order) cut into the batches of the decode tasks: ``per_task`` videos each,
    or, when None, cut by the videos' bytes (what decoding a video costs grows with them), each
    batch 1/(``SHARE_DIVISOR`` x ``parallel``) of the bytes still to cut and at most
    ``MAX_VIDEOS_PER_TASK`` videos: a big build is not one task per video, and the batches shrink
    towards its end (guided self-scheduling), so the last tasks are single videos and every worker
    stays busy to the end. With batches of one size (8 videos at 120 videos and 2 workers: 15 of
    them), one worker decoded the last batch alone."""
    if per_task:
        return [videos[i:i + per_task] for i in range(0, len(videos), per_task)]
    left = sum(max(v.size, 0) for v in videos)
    batches, batch, size = [], [], 0
    for v in videos:
        batch.append(v)
        size += max(v.size, 0)
        if size >= left / (SHARE_DIVISOR * parallel) or len(batch) == MAX_VIDEOS_PER_TASK:
            batches.append(batch)
            left -= size
            batch, size = [], 0
    return batches + [batch] * bool(batch)


def _decode_all(stage, videos, source: Source, cfg, digests: dict | None, tasks, videos_per_task, threads,
                timeout, nodes: Counter, report) -> list[dict]:
    """Every video's staged entry: reused when staging already holds it, else decoded by
    ``tasks`` in batches of the remaining videos (path order, ``plan_batches``). ``digests``: the
    videos' content digests by URL, when they identify them; ``nodes`` counts tasks per Ray node;
    ``report`` gets the counts as work is done."""
    index = {c: i for i, c in enumerate(source.classes)}
    labels = {v.relpath: index[v.label] if v.label is not None else -1 for v in videos}
    keys = {v.relpath: staging.video_key(v, labels[v.relpath], cfg, digests and digests.get(v.url))
            for v in videos}
    done = staging.staged(stage)
    entries = [done[keys[v.relpath]] for v in videos if keys[v.relpath] in done]
    todo = sorted((v for v in videos if keys[v.relpath] not in done), key=lambda v: v.relpath)
    if entries:
        log.info("%d of %d videos already staged by an earlier run", len(entries), len(videos))
    batches = plan_batches(todo, tasks.parallel, videos_per_task)
    pending = {}
    failed = sum(1 for e in entries if e["error"])
    with Progress(len(videos), initial=len(entries), unit="video", desc="decode") as bar:
        with tasks.in_flight(pending):
            while batches or pending:
                while batches and len(pending) < 2 * tasks.parallel:
                    vs = batches.pop(0)
                    ref = tasks.submit(staging.decode_batch, stage, vs, [keys[v.relpath] for v in vs],
                                       [labels[v.relpath] for v in vs], cfg, threads, timeout)
                    pending[ref] = len(vs)
                for ref in tasks.wait(pending):
                    result, node = tasks.result(ref)
                    nodes[node] += 1
                    entries += [{**e, "batch": result["batch"]} for e in result["videos"]]
                    failed += sum(1 for e in result["videos"] if e["error"])
                    bar.update(pending.pop(ref), failed=failed)
                    report({"videos_done": bar.n, "videos_total": len(videos), "failed": failed,
                            "shards_written": 0})
    return sorted(entries, key=lambda e: e["path"])


def _plan_shards(split, entries, seed, shard_size, shard_samples) -> list[tuple[str, list[tuple]]]:
    """The shards of a split: (name, its samples as ``staging.pack_shard``'s pieces), in order."""
    samples = {s["key"]: (s["key"], s["label"], e["batch"], s["offset"], s["length"])
               for e in entries for s in e["samples"]}
    order = [samples[k] for k in ordering.shuffled(samples, seed)]
    cuts = packing.cut([p[4] for p in order], shard_size, shard_samples)
    return [(packing.shard_name(split, i), order[r.start:r.stop]) for i, r in enumerate(cuts)]


def _check_room(out: str, plans: dict) -> None:
    """Refuse before any shard is written when a local ``out`` has no room for them all (the staged
    copy of the samples is deleted only once they are written)."""
    free = storage.free_bytes(out)
    needed = sum(packing.shard_bytes(p[4] for p in pieces)
                 for planned in plans.values() for _, pieces in planned)
    if free is not None and needed > free:
        raise NoSpace(f"{out}: no room for the shards: they need {needed:,} bytes, {free:,} are free "
                      "(the staged samples are deleted only once the shards are written)")


def _pack_split(tasks, out, stage, split, planned, nodes: Counter, report) -> list[ShardInfo]:
    refs = [tasks.submit(staging.pack_shard, out, name, stage, pieces) for name, pieces in planned]
    infos = []
    with Progress(len(refs), unit="shard", desc=f"pack {split}") as bar, tasks.in_flight(refs):
        for ref in refs:
            info, node = tasks.result(ref)
            nodes[node] += 1
            infos.append(ShardInfo(**info))
            bar.update()
            report(len(infos))
    log.info("%s: %s in %s", split, plural(sum(len(pieces) for _, pieces in planned), "clip"),
             plural(len(infos), "shard"))
    return infos
