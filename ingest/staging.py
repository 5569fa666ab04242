"""The two kinds of work a build hands to Ray workers.

``decode_batch``: a fixed batch of videos -> one staged file of sample bytes plus a small
JSON index, written under the build's staging directory; the index is written last and marks
the batch done, so a rerun skips it. ``pack_shard``: sample byte ranges cut from staged files
-> one final shard. Only small indexes travel back to the driver.
"""
from __future__ import annotations

import json
import logging
import traceback
from collections import defaultdict

from fsspec.core import url_to_fs

from shards import packing, storage

from .clips import ClipConfig, make_clips
from .decode import DecodeError
from .sources import Video

log = logging.getLogger("ingest.staging")


def batch_urls(stage: str, batch_id: str) -> tuple[str, str]:
    return storage.join(stage, f"{batch_id}.tar"), storage.join(stage, f"{batch_id}.json")


def decode_batch(stage: str, batch_id: str, videos: list[Video], labels: list[int], cfg: ClipConfig,
                 threads: int = 1, timeout: float = 600) -> dict:
    data_url, index_url = batch_urls(stage, batch_id)
    if storage.exists(index_url):
        return json.loads(storage.read_bytes(index_url))
    pieces, samples, errors, pos = [], [], [], 0
    for video, label in zip(videos, labels):
        try:
            clips = make_clips(video, label, cfg, threads=threads, timeout=timeout)
        except DecodeError as e:
            errors.append({"path": video.relpath, "split": video.split, "reason": e.reason,
                           "ffmpeg": e.detail})
            continue
        except Exception as e:  # a bug or a resource error must not stop the other videos
            errors.append({"path": video.relpath, "split": video.split,
                           "reason": f"unexpected {type(e).__name__}: {e}",
                           "ffmpeg": traceback.format_exc(limit=3)})
            continue
        for key, lab, data in clips:
            samples.append({"key": key, "label": lab, "offset": pos, "length": len(data)})
            pieces.append(data)
            pos += len(data)
    result = {"batch": batch_id, "videos": len(videos), "samples": samples, "errors": errors}
    storage.atomic_write(data_url, b"".join(pieces))
    storage.atomic_write(index_url, json.dumps(result, sort_keys=True).encode())
    return result


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
                               ((k, lab, chunks[(b, off)]) for k, lab, b, off, _ in pieces))
    return info.__dict__
