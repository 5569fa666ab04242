"""``ingest build --catalog``: builds registered in the dataset catalog, found again by their id.

The dataset id (``shards.catalog.ids``) is taken over
  * the inputs: with ``--fingerprint stat`` (the default) every video's URL (local paths made
    absolute), size, modification stamp (mtime, or the store's ETag or update time where there is
    no mtime) and label; with ``--fingerprint content`` every video's path under the source, the
    SHA-256 of its bytes and its label (``ingest.content_digests``), so a corrected video is a new
    input and the same videos under another source directory are the same; and the class list
    (an empty class folder shifts the class indices);
  * the options that change the output bytes: the clip config (frames, clips per video, eval
    clips, short side, quality, restart interval, seed, decoder, and the motion fields when there are
    any), the shard size or sample count, the splits, the source layout (for UCF101 and HMDB51 with
    its split set), and ``fingerprint: content`` when the inputs were hashed;
  * the shard format version.
Workers, videos per task, timeouts, ffmpeg threads, the output location and the Ray address
cannot change the bytes and are left out, so the same build asked for anywhere is found.

A build claims its id in the catalog first (``Catalog.claim``): a ready set with that id is
reused wherever it lives and nothing is decoded; a set another live process is building is
waited for; otherwise this process builds, heartbeating its lease, reporting progress, and
records the set as ready (with its split counts, file digests and the files' stamps) or failed.

Sets are not replaced behind the catalog's back. Before claiming, a finished set at ``--out``
built with other options is refused unless ``--force`` (``ingest.outdir.refuse_other_options``),
and a set the catalog records there is replaced only with ``--force``, its record then marked
replaced (``Catalog.claim``). A ready set whose manifest is no longer the one registered
(``shards.catalog.condition``: rebuilt or edited without the catalog) is not reused: the build is
refused naming what is there now, and ``--force`` rebuilds it. A build without ``--catalog``
asks ``guard`` before it replaces a set: the default catalog, if there is one, may record it.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass

from shards.catalog import (
    HEARTBEAT_SECONDS,
    Catalog,
    CatalogError,
    CatalogUnavailable,
    Claim,
    Record,
    dataset_id,
    default_path,
)
from shards.catalog.condition import condition
from shards.catalog.store import LEASE_SECONDS
from shards.format.manifest import LEDGER_NAME, MANIFEST_NAME, SET_FILES, Manifest
from shards.io import storage
from shards.tools.verify import set_file_stamps, stamps

from . import content_digests
from .build import Summary
from .build import build as ingest_build
from .clips import ClipConfig
from .outdir import byte_options, normalise, refuse_other_options
from .sources import Source, discover
from .tasks import runtime

log = logging.getLogger("ingest.registry")


@dataclass
class Plan:
    """A build asked for: its id, the discovered source and the options behind the id."""
    id: str
    src: str
    source: Source
    cfg: ClipConfig
    shard_size: int | None
    shard_samples: int | None
    splits: list[str]
    options: dict  # the byte-changing options, as recorded
    fingerprint: str = "stat"  # what identifies the inputs (``ingest.content_digests``)
    hash_cache: str | None = None  # where content digests are cached (None: the default)


def plan(src: str, cfg: ClipConfig = ClipConfig(), *, shard_size: int | None = 256 * 10**6,
         shard_samples: int | None = None, splits=("train", "val", "test"), fingerprint: str = "stat",
         hash_cache: str | None = None, address: str | None = None, workers: int | None = None,
         split_set: int = 1) -> Plan:
    """List the inputs and compute the dataset id of building them with these options.
    ``fingerprint="content"`` hashes the inputs on Ray (``address``, ``workers``) first."""
    src = normalise(src)
    source = discover(src, split_set)  # the split set is in source.layout, and so in the id
    videos = [v for v in source.videos if v.split in splits]
    present = sorted({v.split for v in videos})
    shard_size = None if shard_samples else shard_size
    options = {"clip": cfg.as_dict(), "shard_size": shard_size, "shard_samples": shard_samples,
               "splits": present}
    if fingerprint == "content":
        with closing(runtime.start(address, workers, len(videos))) as tasks:
            digests = content_digests.digests(videos, hash_cache, tasks)
        inputs = [{"path": v.relpath, "sha256": digests.get(v.url), "label": v.label} for v in videos]
        options["fingerprint"] = "content"
    else:  # the ids of every set built before content fingerprints existed: left as they were
        inputs = [{"path": storage.join(src, v.relpath), "size": v.size, "stamp": v.stamp, "label": v.label}
                  for v in videos]
    ident = dataset_id(inputs, {**options, "classes": source.classes, "layout": source.layout})
    return Plan(ident, src, source, cfg, shard_size, shard_samples, present, options, fingerprint, hash_cache)


def claim(catalog: Catalog, p: Plan, out: str, name: str | None = None, force: bool = False,
          request: dict | None = None) -> Claim:
    """Claim ``p.id`` for a build into ``out``; unnamed sets are named after ``out``'s last part.
    ``request``: the HTTP request of a build the service runs (kept for a replica to take it over)."""
    return catalog.claim(p.id, source=p.src, location=normalise(out), options=p.options,
                         name=name or default_name(out), strict_name=name is not None, force=force,
                         request=request)


def default_name(out: str) -> str | None:
    """The catalog name of a set built into ``out`` without ``--name``: its last part."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", normalise(out).rsplit("/", 1)[-1]).strip(".-_") or None


def build(catalog: str | Catalog, src: str, out: str, cfg: ClipConfig = ClipConfig(), *,
          name: str | None = None, force: bool = False, poll: float = 1.0,
          shard_size: int | None = 256 * 10**6, shard_samples: int | None = None,
          splits=("train", "val", "test"), fingerprint: str = "stat",
          hash_cache: str | None = None, max_error_fraction: float | None = None, **build_kwargs):
    """``ingest.build.build`` through the catalog; returns (summary, record). A build in which more
    than ``max_error_fraction`` of the videos failed is recorded failed (see ``run_claimed``)."""
    cat = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    p = plan(src, cfg, shard_size=shard_size, shard_samples=shard_samples, splits=splits,
             fingerprint=fingerprint, hash_cache=hash_cache, address=build_kwargs.get("address"),
             workers=build_kwargs.get("workers"), split_set=build_kwargs.get("split_set", 1))
    known = cat.get(p.id)
    if not (known and known.state == "ready") or force:
        # a build, not a reuse: never over another set unasked
        refuse_other_options(normalise(out), byte_options(p.source.layout, p.cfg, p.shard_size,
                                                          p.shard_samples, p.splits), force)
    waited = False
    while True:
        c = claim(cat, p, out, name, force)
        if c.action == "reuse" and not storage.exists(storage.join(c.record.location, MANIFEST_NAME)):
            log.warning("dataset %s is recorded at %s, but its manifest is gone: rebuilding", p.id,
                        c.record.location)
            force = True
            continue
        found = condition(c.record) if c.action == "reuse" else None
        if found and found.state == "changed":  # never "up to date" over files that are not the set
            raise CatalogError(f"dataset {c.record.id} ({c.record.name}) is changed: {found.problem}; "
                               f"--force rebuilds it there, or shard-service remove {c.record.id[:12]} "
                               "forgets it")
        if c.action != "wait":
            break
        if not waited:
            log.info("dataset %s is being built by %s pid %s into %s; waiting for it", p.id,
                     c.record.owner.get("host"), c.record.owner.get("pid"), c.record.location)
            waited = True
        time.sleep(poll)
    if c.action == "reuse":
        rec = c.record
        log.info("dataset %s (%s) is already built at %s; nothing decoded (--force rebuilds)",
                 rec.id, rec.name, rec.location)
        summary = Summary(videos=sum(v.split in p.splits for v in p.source.videos), reused=True,
                          missing=sum(m.split in p.splits for m in p.source.missing))
        for s in rec.splits.values():
            summary.clips, summary.bytes = summary.clips + s["clips"], summary.bytes + s["bytes"]
            summary.shards, summary.failed = summary.shards + s["shards"], summary.failed + s["failed"]
        return summary, rec
    return (run_claimed(cat, c, p, force=force, max_error_fraction=max_error_fraction, **build_kwargs),
            cat.get(p.id))


def run_claimed(cat: Catalog, c: Claim, p: Plan, force: bool = False, max_error_fraction: float | None = None,
                lost: Callable[[], None] | None = None, **build_kwargs):
    """Build a claimed id into its record's location: heartbeat, progress, then ready or failed.
    ``force``: rebuild even if the location holds a finished build. More than ``max_error_fraction``
    of the videos failed: recorded failed, so it is neither served nor reused, and ``gc`` collects it
    (a rerun finds the finished work and records it failed again). ``lost``: called when another
    process has taken the record over (default: a warning, and the build goes on).

    A catalog that cannot be reached for a while (a PostgreSQL restart) costs heartbeats and progress
    reports, not the build; its outcome is recorded once the catalog answers again."""
    dataset, owner = c.record.id, c.owner
    stop = keep_alive(cat, dataset, owner, lost)
    last = [0.0]

    def progress(state: dict) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0 or state.get("final"):
            last[0] = now
            try:
                cat.set_progress(dataset, owner, state)
            except CatalogUnavailable as e:
                log.warning("dataset %s: progress not recorded: %s", dataset, e)

    try:
        summary = ingest_build(p.src, c.record.location, p.cfg, source=p.source, shard_size=p.shard_size,
                               shard_samples=p.shard_samples, splits=p.splits, fingerprint=p.fingerprint,
                               hash_cache=p.hash_cache, progress=progress, force=force, **build_kwargs)
        splits, files, manifest_sha = describe_set(c.record.location)
        verified = {**stamps(Manifest.load(c.record.location)), **set_file_stamps(c.record.location, files)}
    except BaseException as e:
        stop.set()
        why = f"{type(e).__name__}: {e}"
        until_reachable(lambda: cat.fail(dataset, owner, why))
        raise
    stop.set()
    if max_error_fraction is not None and summary.failed > max_error_fraction * max(1, summary.videos):
        until_reachable(lambda: cat.fail(
            dataset, owner, f"{summary.failed} of {summary.videos} videos failed "
            f"(more than {max_error_fraction:.1%}); see {storage.join(c.record.location, LEDGER_NAME)}"))
        log.warning("dataset %s: too many videos failed; recorded failed", dataset)
        return summary
    if not until_reachable(lambda: cat.finish(
            dataset, owner, splits=splits, files=files, manifest_sha256=manifest_sha,
            verified_files=verified, builder_version=_version(),
            progress={"videos_done": summary.videos, "videos_total": summary.videos,
                      "failed": summary.failed, "shards_written": summary.shards})):
        rec = cat.get(dataset)
        # else: a commit whose answer was lost
        if not (rec and rec.state == "ready" and rec.manifest_sha256 == manifest_sha):
            log.warning("dataset %s: built, but another process had taken the record over", dataset)
    log.info("dataset %s registered at %s", dataset, c.record.location)
    return summary


def keep_alive(cat: Catalog, dataset: str, owner: dict,
               lost: Callable[[], None] | None = None) -> threading.Event:
    """Heartbeat ``owner``'s lease on ``dataset`` from a thread until the event returned is set;
    ``lost()`` once another process has taken the record over (default: a warning). A heartbeat the
    catalog cannot take (it is unreachable) is tried again at the next beat."""
    stop = threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT_SECONDS):
            try:
                held = cat.heartbeat(dataset, owner)
            except CatalogUnavailable as e:
                log.warning("dataset %s: heartbeat not recorded: %s", dataset, e)
                continue
            if not held:
                log.warning("dataset %s: another process has taken this build over", dataset)
                if lost is not None:
                    lost()
                return

    threading.Thread(target=beat, daemon=True, name=f"heartbeat-{dataset[:8]}").start()
    return stop


def until_reachable(write: Callable[[], bool | None], seconds: float = LEASE_SECONDS):
    """``write()``, tried again while the catalog cannot be reached, for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return write()
        except CatalogUnavailable as e:
            if time.monotonic() > deadline:
                raise
            log.warning("%s; trying again", e)
            time.sleep(1.0)


def describe_set(location: str) -> tuple[dict, dict, str]:
    """(per-split counts, {file: [size, sha256]} of the set's small files, the manifest's sha256),
    read back from storage: what the catalog records of a ready set."""
    files = {}
    for name in SET_FILES:
        if name != MANIFEST_NAME and not storage.exists(storage.join(location, name)):
            continue  # sets written by other tools may lack them
        data = storage.read_bytes(storage.join(location, name))
        files[name] = [len(data), hashlib.sha256(data).hexdigest()]
    m = Manifest.load(location)
    splits = {name: {"clips": s.num_samples, "bytes": s.num_bytes,
                     "shards": len(s.shards), "failed": s.num_failed}
              for name, s in m.splits.items()}
    return splits, files, files[MANIFEST_NAME][1]


def guard(out: str, force: bool, catalog: str | None = None) -> Callable[[Manifest], None]:
    """``ingest.build.build``'s ``replacing`` hook for a build without ``--catalog``: a set that
    ``catalog`` (default: the default catalog, if that file exists) records at ``out`` is replaced
    only with ``force``, and its record is then marked replaced (``Catalog.replace_at``)."""
    path = catalog or default_path()

    def replacing(existing: Manifest) -> None:
        if not os.path.exists(path):
            return
        try:
            marked = Catalog(path).replace_at(normalise(out), force)
        except CatalogError as e:
            raise CatalogError(f"{e} (it is registered in the catalog {path})") from None
        for rec in marked:
            log.warning("dataset %s (%s) in %s: marked replaced by this build", rec.id, rec.name, path)
    return replacing


def _version() -> str:
    try:
        return importlib.metadata.version("kinetics-fast")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def where(record: Record) -> str:
    """One line saying where a set lives."""
    return f"dataset {record.id} ({record.name or 'unnamed'}) at {record.location}"
