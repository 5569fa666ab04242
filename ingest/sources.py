"""Finding the videos of a source tree and their labels.

Four layouts are understood:
  * class folders: ``SRC/{train,val,test}/<label>/<id>.<ext>`` (a test split may be flat);
  * the CVDF download layout: flat ``SRC/{train,val,test}/<youtube_id>_<start:06d>_<end:06d>.mp4``
    with ``SRC/annotations/{train,val,test}.csv``
    (``label,youtube_id,time_start,time_end,split[,is_cc]``; test has no label);
  * UCF101 as distributed (``ucf101``): ``SRC[/UCF-101]/<Class>/v_<Class>_gXX_cYY.avi`` with
    ``SRC/ucfTrainTestlist/{classInd,trainlist0N,testlist0N}.txt``;
  * HMDB51 as distributed (``hmdb51``): ``SRC/<class>/<name>.avi`` with
    ``SRC/testTrainMulti_7030_splits/<class>_test_splitN.txt`` (``<name>.avi 1|2|0``: train,
    test, unused).
The class index of a label is its position in the sorted list of all labels of all splits, but
for UCF101, where it is ``classInd.txt``'s (1-based there, 0-based here). UCF101 and HMDB51 come
with three train/test split sets (``split_set``): their train lists become the ``train`` split
and their test lists the ``val`` split (labeled, what the trainer evaluates on); videos a split
set does not list are left out.
Videos of a labeled split (train, val) without a label are listed with ``label=None``; the
build records them in its ledger instead of decoding them. Videos a list names that are not there
are ``Source.missing`` (the build lists each in its ledger). An annotation CSV is read as UTF-8,
with or without a BOM, and refused in one line naming the file and line (``BadAnnotations``) where
it cannot be read as written. A symbolic link is followed wherever it points.
"""
from __future__ import annotations

import csv
import hashlib
import io
import logging
import unicodedata
from collections import Counter
from dataclasses import dataclass, replace

from fsspec.core import url_to_fs

from shards.base.errors import NotFound, UsageError
from shards.base.words import plural, printable
from shards.format.tar import sanitize_key
from shards.io import storage

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
    kind: str = "file"  # "file", "directory", "dangling" (a link to nothing) or "other" (a pipe, a
    # socket, a device): anything but a file is a failure later
    stamp: float | str | None = None  # modification time, or the store's ETag or update time
    ctime: float | None = None  # local files: the inode's last change (what a preserved mtime hides)
    inode: int = 0  # local files


@dataclass(frozen=True)
class Missing:
    """A video the source's lists name that is not there (normal for Kinetics: 5-10% of ids)."""
    split: str
    path: str  # where it would be, relative to SRC (its extension unknown: the video id)
    listed: str  # where it is named: ``annotations/train.csv line 12``, ``split set 1``


@dataclass
class Source:
    layout: str
    videos: list[Video]
    classes: list[str]
    missing: list[Missing]  # videos listed with no file (normal for Kinetics)

    def fingerprint(self, digests: dict[str, str] | None = None) -> str:
        """Hash of the input set: relative paths, labels and sizes (not mtimes), or, given
        ``digests`` (URL -> SHA-256 of the content), those digests in place of the sizes."""
        h = hashlib.sha256()
        for v in sorted(self.videos, key=lambda v: v.relpath):
            h.update(f"{v.relpath}\0{v.size if digests is None else digests.get(v.url)}\0"
                     f"{v.label}\n".encode())
        return h.hexdigest()[:16]


def _ext(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:].lower() if dot >= 0 else ""


def stamp_of(info: dict) -> float | str | None:
    """A listing entry's modification stamp: the mtime, else the store's update time or ETag."""
    stamp = next((info[k] for k in _STAMP_KEYS if info.get(k) is not None), None)
    return stamp if isinstance(stamp, (int, float)) or stamp is None else str(stamp)


def _kind(info: dict) -> str:
    return {"file": "file", "directory": "directory"}.get(info.get("type"), "other")


def _walk(src: str, split: str) -> tuple[list[tuple[str, int, str, dict]], set[str]]:
    """Video-named entries under folder ``split`` of src (a split, or any folder), dirs included,
    as (relpath under src, size, kind, what ``Video`` records of its stat), and the names of its
    top-level folders (class folders, empty ones too), from one recursive listing (plus a stat of
    each symbolic link's target)."""
    fs, root = url_to_fs(storage.join(src, split) if split else src)
    if not fs.exists(root):
        return [], set()
    root = root.rstrip("/")
    videos, folders = [], set()
    for path, info in sorted(fs.find(root, withdirs=True, detail=True).items()):
        rel = path.rstrip("/")[len(root) + 1:]
        kind = _kind(info)
        if _ext(rel) not in VIDEO_EXTS:
            if kind == "directory" and rel and "/" not in rel:
                folders.add(rel)
            continue
        if info.get("islink"):  # followed wherever it points: a tree of links into a download cache is common
            try:
                info = fs.info(path)  # the target's type, size, times and inode, not the link's
                kind = _kind(info)
            except FileNotFoundError:
                kind = "dangling"
        stat = {"stamp": stamp_of(info), "ctime": info.get("created") if "ino" in info else None,
                "inode": info.get("ino") or 0} if kind == "file" else {}
        size = (info.get("size") or 0) if kind == "file" else -1
        videos.append((f"{split}/{rel}" if split else rel, size, kind, stat))
    return videos, folders


def _stem(relpath: str) -> str:
    name = relpath.rsplit("/", 1)[-1]
    return name[: name.rfind(".")] if "." in name else name


class BadAnnotations(UsageError):
    """An annotation CSV that cannot be read as written: the message names the file, the line and
    what is wrong with it."""


ANNOTATION_COLUMNS = ("youtube_id", "time_start", "time_end")  # and "label" but in an unlabeled split


def _read_annotations(src: str, split: str) -> dict[str, tuple[str | None, int]] | None:
    """``SRC/annotations/<split>.csv`` as {video id: (label, line)}; None when there is none.
    UTF-8 with or without a BOM (what a spreadsheet saves), one row per video: a row of too few or
    too many fields, a time that is not a number, a label holding a line break (which would split
    ``classes.txt``), or an id given two labels is refused (``BadAnnotations``), naming the line."""
    url = storage.join(src, "annotations", f"{split}.csv")
    if not storage.exists(url):
        return None
    data = storage.read_bytes(url)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise BadAnnotations(f"{url}: not UTF-8: byte 0x{data[e.start]:02x} at offset {e.start:,} "
                             f"(line {line}); save it as UTF-8 (with or without a BOM)") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    header = [h.strip() for h in next(reader, [])]
    lacking = [c for c in ANNOTATION_COLUMNS if c not in header]
    if lacking:
        raise BadAnnotations(f"{url}: line 1: no {', '.join(lacking)} column (the header is "
                             f"'{printable(','.join(header))}')")
    out, start = {}, reader.line_num + 1
    for row in reader:
        line, start = start, reader.line_num + 1  # a quoted field may span lines: the row's first
        if not row:
            continue
        if len(row) != len(header):
            raise BadAnnotations(f"{url}: line {line}: {plural(len(row), 'field')}, the header has "
                                 f"{len(header)} ({printable(','.join(header))})")
        fields = dict(zip(header, row))
        times = []
        for column in ("time_start", "time_end"):
            try:
                times.append(int(float(fields[column])))
            except (ValueError, OverflowError):
                raise BadAnnotations(f"{url}: line {line}: {column} '{printable(fields[column])}' is not a "
                                     "number of seconds") from None
        vid = f"{fields['youtube_id']}_{times[0]:06d}_{times[1]:06d}"
        label = (fields.get("label") or "").strip() or None
        if label is not None and any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in label):
            raise BadAnnotations(f"{url}: line {line}: the label '{printable(label)}' holds a line break or "
                                 "another control character")
        if vid in out and out[vid][0] != label:
            raise BadAnnotations(f"{url}: lines {out[vid][1]} and {line} give {printable(vid)} two labels, "
                                 f"'{printable(out[vid][0])}' and '{printable(label)}'")
        out.setdefault(vid, (label, line))
    return out


def discover(src: str, split_set: int = 1) -> Source:
    """List the videos of every split under ``src`` with their labels and the class list;
    ``split_set``: which of UCF101's or HMDB51's three train/test splits."""
    src = src.rstrip("/")
    if storage.exists(storage.join(src, UCF_LISTS, "classInd.txt")):
        return _split_files(src, "ucf101", split_set, _ucf101_lists(src, split_set))
    if storage.exists(storage.join(src, HMDB_LISTS)):
        return _split_files(src, "hmdb51", split_set, _hmdb51_lists(src, split_set))
    annotations = {s: _read_annotations(src, s) for s in SPLITS}
    cvdf = any(a is not None for a in annotations.values())
    videos, classes, missing = [], set(), []
    for split in SPLITS:
        entries, folders = _walk(src, split)
        if cvdf:
            ann = annotations[split] or {}
            classes.update(label for label, _ in ann.values() if label)
            present = set()
            for rel, size, kind, stat in entries:
                vid = _stem(rel)
                present.add(vid)
                if ann and vid not in ann:
                    log.warning("%s: not in annotations/%s.csv; skipped", rel, split)
                    continue
                label = ann.get(vid, (None,))[0]
                videos.append(Video(split, rel, storage.join(src, rel), label, vid, size, kind, **stat))
            missing += [Missing(split, f"{split}/{vid}", f"annotations/{split}.csv line {line}")
                        for vid, (_, line) in ann.items() if vid not in present]
        else:
            classes.update(folders)
            for rel, size, kind, stat in entries:
                parts = rel.split("/")
                label = parts[1] if len(parts) >= 3 else None
                classes.update([label] if label else [])
                videos.append(Video(split, rel, storage.join(src, rel), label, _stem(rel), size, kind,
                                    **stat))
    if not videos:
        raise NotFound(_why_no_videos(src))
    return Source("cvdf" if cvdf else "class-folders", _unique_ids(videos), sorted(classes), missing)


UCF_LISTS = "ucfTrainTestlist"
HMDB_LISTS = "testTrainMulti_7030_splits"
SPLIT_SETS = (1, 2, 3)


def _lines(url: str) -> list[str]:
    try:
        text = storage.read_bytes(url).decode("utf-8-sig")
    except FileNotFoundError:
        raise FileNotFoundError(f"{url}: split file missing") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def _ucf101_lists(src: str, split_set: int) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """(classes in classInd order, {video path under the class folders: (split, class)})."""
    classes = [line.split()[1] for line in sorted(_lines(storage.join(src, UCF_LISTS, "classInd.txt")),
                                                  key=lambda line: int(line.split()[0]))]
    listed = {}
    for split, name in (("train", f"trainlist{split_set:02d}.txt"), ("val", f"testlist{split_set:02d}.txt")):
        for line in _lines(storage.join(src, UCF_LISTS, name)):
            path = line.split()[0]  # trainlist lines end with the 1-based class index, testlist lines do not
            listed[path] = (split, path.split("/")[0])
    return classes, listed


def _hmdb51_lists(src: str, split_set: int) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """(classes sorted, {video path under the class folders: (split, class)}), from the
    ``<class>_test_split<N>.txt`` files (1: train, 2: test, 0: unused)."""
    fs, root = url_to_fs(storage.join(src, HMDB_LISTS))
    suffix = f"_test_split{split_set}.txt"
    files = sorted(p for p in fs.ls(root, detail=False) if p.endswith(suffix))
    if not files:
        raise FileNotFoundError(f"{storage.join(src, HMDB_LISTS)}: no <class>{suffix} files")
    classes, listed = [], {}
    for path in files:
        label = path.rsplit("/", 1)[-1][: -len(suffix)]
        classes.append(label)
        for line in fs.cat_file(path).decode("utf-8-sig").splitlines():
            if line.split() and line.split()[-1] in ("1", "2"):
                listed[f"{label}/{line.split()[0]}"] = ("train" if line.split()[-1] == "1" else "val", label)
    return sorted(classes), listed


def _split_files(src: str, dataset: str, split_set: int, lists) -> Source:
    """The videos a UCF101 or HMDB51 split set lists, found in one listing of the class folders
    (under ``SRC/UCF-101`` when the archive was unpacked there, else ``SRC``)."""
    if split_set not in SPLIT_SETS:
        raise ValueError(f"split set must be one of {SPLIT_SETS}, not {split_set}")
    classes, listed = lists
    folder = "UCF-101" if dataset == "ucf101" and storage.exists(storage.join(src, "UCF-101")) else ""
    entries, _ = _walk(src, folder)
    found = {rel[len(folder) + 1:] if folder else rel: (rel, size, kind, stat)
             for rel, size, kind, stat in entries}
    videos, missing = [], []
    for path, (split, label) in sorted(listed.items()):
        if path not in found:
            missing.append(Missing(split, f"{folder}/{path}" if folder else path, f"split set {split_set}"))
            continue
        rel, size, kind, stat = found[path]
        videos.append(Video(split, rel, storage.join(src, rel), label, _stem(rel), size, kind, **stat))
    if not videos:
        raise FileNotFoundError(f"{src}: none of the {len(listed)} videos split set {split_set} lists "
                                "is there")
    return Source(f"{dataset}-split{split_set}", _unique_ids(videos), classes, missing)


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
        return (f"{src}: no videos found under {'/'.join(SPLITS)}, but {len(flat)} directly in it: "
                f"expected {layout}")
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
