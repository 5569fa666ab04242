"""Check every shard against the manifest: size, SHA-256, sample offsets, members; --deep decodes JPEGs
and motion fields.

Each shard is read once, front to back, and each problem is printed with its shard and, where
it has one, its sample. Exit status 1 if there is any problem. Only the manifest and the
shards it names are opened: nothing is listed.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
from PIL import Image

from ..base.words import plural
from ..format import motionfield
from ..format.digests import ALGORITHM, read_upto, sample_digest
from ..format.manifest import Manifest, ShardInfo
from ..format.sample import BadSample, parse
from ..read.reading import local_path

CHUNK = 8 << 20


@dataclass
class Problem:
    shard: str
    sample: str | None
    message: str

    def __str__(self) -> str:
        return f"{self.shard}: {'sample ' + self.sample + ': ' if self.sample else ''}{self.message}"


def check_members(key: str, label: int, data, frames: int | None, deep: bool,
                  motion: str = "none") -> list[str]:
    """What is wrong with one sample's tar bytes (empty list when nothing): what the readers' parser
    (``shards.format.sample.parse``) refuses, metadata that is not a JSON object, frame headers that
    do not parse (``Sample.frame_sizes``), and with ``deep`` frames and motion fields (``motion``:
    ``Manifest.motion``) that do not decode."""
    try:
        sample = parse(data, key, label=label, frames=frames, motion=motion)
        sample.meta()
        sample.frame_sizes()
    except BadSample as e:
        return [e.why]
    if not deep:
        return []
    problems, sizes = [], []
    for t, jpeg in enumerate(sample.frames):
        try:
            with Image.open(io.BytesIO(jpeg)) as im:
                im.load()
                sizes.append(im.size)
        except Exception as e:  # noqa: BLE001 -- PIL raises several types for corrupt data
            problems.append(f"frame {t:02d} does not decode ({e})")
            sizes.append(None)
    for t, (png, size) in enumerate(zip(sample.fields, sizes)):
        problems += _check_field(motionfield.member(t, motion), png, size)
    return problems


def _check_field(name: str, png, frame: tuple[int, int] | None) -> list[str]:
    """The motion field decodes, with the grid its frame's size (None: a frame that did not decode)
    calls for."""
    try:
        field, _ = motionfield.decode(png)
    except Exception as e:  # noqa: BLE001 -- PIL raises several types for corrupt data
        return [f"motion field {name} does not decode ({e})"]
    if frame is not None and field.shape[1::-1] != motionfield.grid_size(*frame):
        return [(f"motion field {name} is {field.shape[1]}x{field.shape[0]}, its {frame[0]}x{frame[1]} "
                 f"frame calls for {'x'.join(map(str, motionfield.grid_size(*frame)))}")]
    return []


def check_shard(url: str, info: ShardInfo, frames: int | None = None, deep: bool = False,
                keep: list[bytes] | None = None, motion: str = "none",
                hashed: dict | None = None) -> list[Problem]:
    """All problems of one shard: read sequentially, samples checked at their manifest offsets.

    ``keep``: a list that receives each sample's bytes as read (``shards reshard`` copies them,
    and only when the whole shard came out clean). ``hashed``: a dict that receives the file's
    ``[size, mtime_ns, sha256]`` as read (local files only; the stamp taken before reading, so a
    file that changes meanwhile no longer matches it)."""
    stamp = _stamp(url)
    out = []
    bad = lambda sample, msg: out.append(Problem(info.name, sample, msg))  # noqa: E731
    h, pos, complete = hashlib.sha256(), 0, False
    try:
        f = fsspec.open(url, "rb").open()
    except FileNotFoundError:
        bad(None, "missing")
        return out
    with f:
        for i, key in enumerate(info.keys):
            if info.offsets[i] != pos:
                bad(key, f"manifest offset {info.offsets[i]}, but the previous sample ends at {pos}")
                break
            data = read_upto(f, info.lengths[i])
            h.update(data)
            pos += len(data)
            if len(data) < info.lengths[i]:
                bad(key, f"the shard ends at byte {pos:,}, inside this sample: {info.bytes - pos:,} of the "
                    f"manifest's {info.bytes:,} bytes missing (a partial copy?); "
                    f"{info.num_samples - i - 1} later samples missing")
                break
            if info.digests and sample_digest(data) != info.digests[i]:
                bad(key, f"{ALGORITHM} digest differs from the manifest's")
            for msg in check_members(key, info.labels[i], data, frames, deep, motion):
                bad(key, msg)
            if keep is not None:
                keep.append(data)
        else:
            complete = True
        trailing = False  # anything but the zero blocks that end the archive
        while chunk := f.read(CHUNK):
            h.update(chunk)
            pos += len(chunk)
            trailing = trailing or bool(chunk.strip(b"\0"))
    if pos != info.bytes:
        bad(None, f"{pos} bytes, manifest says {info.bytes}" + (" (truncated)" if pos < info.bytes else ""))
    elif trailing and complete:
        bad(None, "data after the last sample")
    if h.hexdigest() != info.sha256:
        bad(None, "SHA-256 differs from the manifest (content changed)")
    if hashed is not None and stamp is not None:
        hashed[info.name] = [*stamp, h.hexdigest()]
    if len(info.keys) != info.num_samples or len(set(info.keys)) != len(info.keys):
        bad(None, "manifest lists inconsistent or duplicate sample keys")
    return out


def _stamp(url: str) -> list[int] | None:
    """A local file's [size, mtime_ns] (None when missing or remote)."""
    path = local_path(url)
    try:
        st = os.stat(path) if path is not None else None
    except FileNotFoundError:
        return None
    return None if st is None else [st.st_size, st.st_mtime_ns]


def stamps(manifest: Manifest) -> dict:
    """{shard: [size, mtime_ns, sha256]} of a freshly written local set, the SHA-256 the writer
    computed as it wrote each shard (what ``verify(hashed=...)`` records after hashing again)."""
    out = {}
    for split in manifest.splits.values():
        for shard in split.shards:
            stamp = _stamp(manifest.shard_url(shard))
            if stamp is not None:
                out[shard.name] = [*stamp, shard.sha256]
    return out


def set_file_stamps(location: str, names) -> dict:
    """{name: [size, mtime_ns, sha256]} of a local set's small files (``manifest.json``,
    ``classes.txt``, ``errors.jsonl``: ``names``) as they are now, each stamped before it is read;
    {} for a remote set."""
    out = {}
    for name in names:
        url = f"{location.rstrip('/')}/{name}"
        stamp = _stamp(url)
        if stamp is not None:
            with open(local_path(url), "rb") as f:
                out[name] = [*stamp, hashlib.file_digest(f, "sha256").hexdigest()]
    return out


def verify(manifest: Manifest, splits: list[str] | None = None, deep: bool = False,
           frames: int | None = None, workers: int = 4, hashed: dict | None = None) -> list[Problem]:
    """Every problem of the set's shards; ``hashed`` receives what was hashed (``check_shard``)."""
    jobs = [(manifest.shard_url(s), s) for name, split in manifest.splits.items()
            if not splits or name in splits for s in split.shards]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        results = pool.map(lambda job: check_shard(job[0], job[1], frames, deep, motion=manifest.motion,
                                                   hashed=hashed), jobs)
        return [p for r in results for p in r]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shardset", help="shard-set directory URL or manifest.json URL")
    p.add_argument("--split", action="append", help="only this split (repeatable)")
    p.add_argument("--deep", action="store_true", help="also decode every JPEG and motion field")
    p.add_argument("--frames", type=int,
                   help="frames per clip to expect (default: the manifest's config.clip.frames)")
    p.add_argument("--workers", type=int, default=4, help="shards checked at once")


def run(args: argparse.Namespace) -> int:
    m = Manifest.load(args.shardset)
    frames = args.frames or m.frames
    problems = verify(m, args.split, args.deep, frames, args.workers)
    for p in problems:
        print(p)
    shards = sum(len(s.shards) for n, s in m.splits.items() if not args.split or n in args.split)
    print(f"{plural(shards, 'shard')} checked{' (deep)' if args.deep else ''}: "
          f"{plural(len(problems), 'problem')}")
    return 1 if problems else 0
