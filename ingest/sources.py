"""Finding the videos of a Kinetics-style source tree and their labels.

Two layouts are understood:
  * class folders: ``SRC/{train,val,test}/<label>/<id>.<ext>`` (a test split may be flat);
  * the CVDF download layout: flat ``SRC/{train,val,test}/<youtube_id>_<start:06d>_<end:06d>.mp4``
    with ``SRC/annotations/{train,val,test}.csv``
    (``label,youtube_id,time_start,time_end,split[,is_cc]``; test has no label).
The class index of a label is its position in the sorted list of all labels of all splits.
Videos of a labeled split (train, val) without a label are listed with ``label=None``; the
build records them in its ledger instead of decoding them.
"""
from __future__ import annotations

import csv
import hashlib
import io
import logging
from collections import Counter
from dataclasses import dataclass, replace

from fsspec.core import url_to_fs

from shards import storage
from shards.errors import NotFound
from shards.tarformat import sanitize_key

log = logging.getLogger("ingest.sources")

SPLITS = ("train", "val", "test")
LABELED_SPLITS = ("train", "val")  # what the trainer learns and validates on; test may be unlabeled
_STAMP_KEYS = ("mtime", "LastModified", "last_modified", "updated", "ETag", "etag", "md5Hash", "created")
VIDEO_EXTS = {".mp4", ".webm", ".mkv", ".avi", ".mov", ".m4v", ".flv", ".mpg", ".mpeg",
              ".3gp", ".ogv", ".wmv", ".ts"}


@dataclass(frozen=True)
class Video:
    split: str
    relpath: str  # relative to SRC, '/'-separated
    url: str  # what a worker opens (local path or fsspec URL)
    label: str | None
    video_id: str  # sample keys are built from it
    size: int  # bytes; -1 when it is not a regular file
    kind: str = "file"  # "file", "directory" or "other": anything but a file is a failure later
    stamp: float | str | None = None  # modification time, or the store's ETag or update time
    ctime: float | None = None  # local files: the inode's last change (what a preserved mtime hides)
    inode: int = 0  # local files


@dataclass
class Source:
    layout: str
    videos: list[Video]
    classes: list[str]
    missing: dict[str, int]  # annotated videos with no file, per split (normal for Kinetics)

    def fingerprint(self, digests: dict[str, str] | None = None) -> str:
        """Hash of the input set: relative paths, labels and sizes (not mtimes), or, given
        ``digests`` (URL -> SHA-256 of the content), those digests in place of the sizes."""
        h = hashlib.sha256()
        for v in sorted(self.videos, key=lambda v: v.relpath):
            h.update(f"{v.relpath}\0{v.size if digests is None else digests.get(v.url)}\0{v.label}\n".encode())
        return h.hexdigest()[:16]


def _ext(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:].lower() if dot >= 0 else ""


def stamp_of(info: dict) -> float | str | None:
    """A listing entry's modification stamp: the mtime, else the store's update time or ETag."""
    stamp = next((info[k] for k in _STAMP_KEYS if info.get(k) is not None), None)
    return stamp if isinstance(stamp, (int, float)) or stamp is None else str(stamp)


def _walk(src: str, split: str) -> tuple[list[tuple[str, int, str, dict]], set[str]]:
    """Video-named entries of a split, dirs included, as (relpath under src, size, kind, what
    ``Video`` records of its stat), and the names of its top-level folders (class folders, empty
    ones too), from one recursive listing (plus a stat of each symbolic link's target)."""
    fs, root = url_to_fs(storage.join(src, split))
    if not fs.exists(root):
        return [], set()
    root = root.rstrip("/")
    videos, folders = [], set()
    for path, info in sorted(fs.find(root, withdirs=True, detail=True).items()):
        rel = path.rstrip("/")[len(root) + 1:]
        kind = {"file": "file", "directory": "directory"}.get(info.get("type"), "other")
        if _ext(rel) not in VIDEO_EXTS:
            if kind == "directory" and rel and "/" not in rel:
                folders.add(rel)
            continue
        if kind == "file" and info.get("islink"):
            try:
                info = fs.info(path)  # the target's times and inode, not the link's
            except FileNotFoundError:
                kind = "other"  # dangling link
        stat = {"stamp": stamp_of(info), "ctime": info.get("created") if "ino" in info else None,
                "inode": info.get("ino") or 0} if kind == "file" else {}
        videos.append((f"{split}/{rel}", (info.get("size") or 0) if kind == "file" else -1, kind, stat))
    return videos, folders


def _stem(relpath: str) -> str:
    name = relpath.rsplit("/", 1)[-1]
    return name[: name.rfind(".")] if "." in name else name


def _read_annotations(src: str, split: str) -> dict[str, str | None] | None:
    url = storage.join(src, "annotations", f"{split}.csv")
    if not storage.exists(url):
        return None
    text = storage.read_bytes(url).decode("utf-8-sig")
    out = {}
    for row in csv.DictReader(io.StringIO(text)):
        vid = f"{row['youtube_id']}_{int(float(row['time_start'])):06d}_{int(float(row['time_end'])):06d}"
        label = (row.get("label") or "").strip() or None
        out[vid] = label
    return out


def discover(src: str) -> Source:
    """List the videos of every split under ``src`` with their labels and the class list."""
    src = src.rstrip("/")
    annotations = {s: _read_annotations(src, s) for s in SPLITS}
    cvdf = any(a is not None for a in annotations.values())
    videos, classes, missing = [], set(), {}
    for split in SPLITS:
        entries, folders = _walk(src, split)
        if cvdf:
            ann = annotations[split] or {}
            classes.update(l for l in ann.values() if l)
            present = set()
            for rel, size, kind, stat in entries:
                vid = _stem(rel)
                present.add(vid)
                if ann and vid not in ann:
                    log.warning("%s: not in annotations/%s.csv; skipped", rel, split)
                    continue
                videos.append(Video(split, rel, storage.join(src, rel), ann.get(vid), vid, size, kind, **stat))
            missing[split] = sum(1 for vid in ann if vid not in present)
        else:
            classes.update(folders)
            for rel, size, kind, stat in entries:
                parts = rel.split("/")
                label = parts[1] if len(parts) >= 3 else None
                classes.update([label] if label else [])
                videos.append(Video(split, rel, storage.join(src, rel), label, _stem(rel), size, kind, **stat))
    if not videos:
        raise NotFound(_why_no_videos(src))
    return Source("cvdf" if cvdf else "class-folders", _unique_ids(videos), sorted(classes), missing)


def _why_no_videos(src: str) -> str:
    """Why ``src`` gave no videos: not there, empty, videos in the wrong place, or none at all."""
    fs, root = url_to_fs(src)
    if not fs.exists(root):
        return f"{src}: no videos found: no such directory"
    top = fs.ls(root, detail=False)
    if not top:
        return f"{src}: no videos found: the directory is empty"
    flat = [p for p in top if _ext(p) in VIDEO_EXTS]
    layout = (f"{src}/train/<label>/<id>.mp4 (class folders) or {src}/train/<id>.mp4 with "
              f"{src}/annotations/train.csv (CVDF), and the same for val and test")
    if flat:
        return f"{src}: no videos found under {'/'.join(SPLITS)}, but {len(flat)} directly in it: expected {layout}"
    return (f"{src}: no videos found under {'/'.join(SPLITS)} (extensions: {', '.join(sorted(VIDEO_EXTS))}): "
            f"expected {layout}")


def _unique_ids(videos: list[Video]) -> list[Video]:
    """Sanitise ids into sample keys; ids that collide inside a split get a path hash suffix."""
    keyed = [(v, sanitize_key(v.video_id)) for v in videos]
    counts = Counter((v.split, k) for v, k in keyed)
    out = []
    for v, k in keyed:
        if counts[(v.split, k)] > 1:
            k = f"{k}_{hashlib.sha1(v.relpath.encode()).hexdigest()[:8]}"
        out.append(replace(v, video_id=k))
    return out
