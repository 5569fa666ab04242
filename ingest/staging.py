"""The two kinds of work a build hands to Ray workers, and the staging area between them.

``decode_batch``: some videos -> one staged file of sample bytes plus a small JSON index,
written under ``OUT/.staging``. Staging is keyed by what it holds: each video's entry is filed
under ``video_key`` (its URL, size, class index, every clip option and, for a build identified
by content, its digest), and a batch file is named after the keys it holds, so a rerun with
other batching, worker count or timeout finds exactly the videos already done, whichever batch
they went in (``staged``). The index is written last and marks the batch done. ``pack_shard``:
sample byte ranges cut from staged files -> one final shard. Only small indexes travel back to the
driver.
"""
from __future__ import annotations

import json
import logging
import traceback
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from fsspec.core import url_to_fs

from shards.format import packing
from shards.format.manifest import digest
from shards.io import storage

from .clips import ClipConfig, make_clips
from .decode.video import DecodeError
from .sources import Video

log = logging.getLogger("ingest.staging")

RETRY = "retry"  # an entry whose failure may not recur (a timeout, a crash): done again on a rerun


def video_key(video: Video, label: int, cfg: ClipConfig, sha256: str | None = None) -> str:
    """Names one video's staged samples: everything that decides their bytes (with ``sha256``, the
    digest of its content, when the build is identified by content). Where the path does not
    name the split (UCF101's and HMDB51's split files), the split, which decides the sampling, does."""
    key = {"url": video.url, "size": video.size, "label": label, "clip": cfg.as_dict()}
    if not video.relpath.startswith(f"{video.split}/"):
        key["split"] = video.split
    return digest(key if sha256 is None else {**key, "sha256": sha256})


def batch_urls(stage: str, batch_id: str) -> tuple[str, str]:
    return storage.join(stage, f"{batch_id}.tar"), storage.join(stage, f"{batch_id}.json")


def batch_id(keys: list[str]) -> str:
    return digest(sorted(keys))


def staged(stage: str, workers: int = 16) -> dict[str, dict]:
    """Every finished entry under ``stage``: video key -> entry (with its ``batch``). Entries
    to be done again (``RETRY``) are left out; of two entries for one key the first batch wins."""
    fs, root = url_to_fs(stage)
    if not fs.exists(root):
        return {}
    names = sorted(p for p in fs.ls(root, detail=False) if p.endswith(".json"))
    with ThreadPoolExecutor(workers) as pool:
        indexes = list(pool.map(lambda p: json.loads(fs.cat_file(p)), names))
    found = {}
    for index in indexes:
        for entry in index["videos"]:
            if not entry.get(RETRY):
                found.setdefault(entry["key"], {**entry, "batch": index["batch"]})
    return found


def ledger_line(video: Video, reason: str, detail: str = "", *, warning: str | None = None) -> dict:
    """One line of the build's ledger (``OUT/errors.jsonl``) about ``video``: a failure (the video is
    left out), or with ``warning`` (its code) a video used with a caveat the reason gives."""
    return {"path": video.relpath, "split": video.split, "reason": reason, "ffmpeg": detail,
            **({"warning": warning} if warning else {})}


def _entry(video: Video, key: str, label: int, cfg: ClipConfig, threads: int, timeout: float):
    """(index entry, sample bytes) of one video; a failure is an entry with an ``error``."""
    entry = {"key": key, "path": video.relpath, "split": video.split, "samples": [], "error": None}
    try:
        clips, warnings = make_clips(video, label, cfg, threads=threads, timeout=timeout)
    except DecodeError as e:
        entry["error"] = ledger_line(video, e.reason, e.detail)
        entry[RETRY] = e.reason.startswith("timed out")
        return entry, []
    except Exception as e:  # a bug or a resource error must not stop the other videos
        entry["error"] = ledger_line(video, f"unexpected {type(e).__name__}: {e}",
                                     traceback.format_exc(limit=3))
        entry[RETRY] = True
        return entry, []
    entry["samples"] = [{"key": k, "label": lab} for k, lab, _ in clips]
    entry["warnings"] = [ledger_line(video, reason, warning=code) for code, reason in warnings]
    return entry, [data for _, _, data in clips]


def decode_batch(stage: str, videos: list[Video], keys: list[str], labels: list[int], cfg: ClipConfig,
                 threads: int = 1, timeout: float = 600) -> dict:
    """Decode ``videos`` into one staged batch, or return the batch's index if already staged."""
    bid = batch_id(keys)
    data_url, index_url = batch_urls(stage, bid)
    if storage.exists(index_url):
        index = json.loads(storage.read_bytes(index_url))
        if not any(e.get(RETRY) for e in index["videos"]):
            return index
    entries, pieces, pos = [], [], 0
    for video, key, label in zip(videos, keys, labels):
        entry, datas = _entry(video, key, label, cfg, threads, timeout)
        for sample, data in zip(entry["samples"], datas):
            sample.update(offset=pos, length=len(data))
            pieces.append(data)
            pos += len(data)
        entries.append(entry)
    index = {"batch": bid, "videos": entries}
    storage.atomic_write(data_url, b"".join(pieces))
    storage.atomic_write(index_url, json.dumps(index, sort_keys=True).encode())
    return index


def pack_shard(out: str, name: str, stage: str, pieces: list[tuple[str, int, str, int, int]]) -> dict:
    """Write shard ``name`` from ``(key, label, batch_id, offset, length)`` in order."""
    by_batch = defaultdict(list)
    for key, label, batch, off, length in pieces:
        by_batch[batch].append((off, length))
    chunks = {}
    for batch, ranges in by_batch.items():
        fs, path = url_to_fs(batch_urls(stage, batch)[0])
        with fs.open(path, "rb") as f:
            for off, length in sorted(ranges):
                f.seek(off)
                chunks[(batch, off)] = f.read(length)
    info = packing.write_shard(storage.join(out, name), name,
                               ((k, lab, chunks[(b, off)]) for k, lab, b, off, _ in pieces),
                               packing.shard_bytes(p[4] for p in pieces))
    return info.__dict__
