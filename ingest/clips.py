"""One video in, its pre-sampled clips out, as WebDataset sample bytes (runs in the workers).

The video is probed once and decoded once for the union of the frames all its clips keep;
each clip becomes one sample: T JPEG frames ``NN.jpg`` in temporal order, ``cls`` and ``json``.
With ``decode="refs"`` (H.264 MP4) clips keep reference frames only, and the decoder skips the
frames no other frame depends on: decoding costs less than decoding the whole video.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import fsspec

from shards import storage
from shards.tarformat import sample_bytes

from . import decode, jpeg, sampling
from .deadline import Deadline, TimedOut
from .decode import DecodeError
from .sources import Video


DECODE_MODES = ("all", "refs")


@dataclass(frozen=True)
class ClipConfig:
    """Everything that decides a sample's bytes (and so goes into the manifest's config)."""
    frames: int = 8
    clips_per_video: int = 1  # training split
    eval_clips: int = 1  # val/test splits: evenly spread centre offsets
    short_side: int = 256
    quality: int = 90
    seed: int = 0
    decode: str = "all"  # "refs": sample reference frames only, and skip decoding the others

    def __post_init__(self):
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, not {self.decode!r}")

    def as_dict(self) -> dict:
        return asdict(self)


@contextmanager
def local_copy(video: Video, deadline: Deadline):
    """A local path to the video: itself if local, else a temporary download
    (ffmpeg cannot seek in a pipe, and most mp4s keep their index at the end)."""
    if storage.is_local(video.url):
        yield video.url
        return
    tmpdir = tempfile.mkdtemp(prefix="ingest-")
    path = os.path.join(tmpdir, "video" + os.path.splitext(video.relpath)[1])
    try:
        deadline.check("downloading")
        with fsspec.open(video.url, "rb") as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        yield path
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _check_file(video: Video, path: str, deadline: Deadline) -> None:
    deadline.check("opening")
    if video.kind == "directory":
        raise DecodeError("is a directory, not a video file")
    if video.kind != "file":
        raise DecodeError("not a regular file (dangling link or special file)")
    try:
        with open(path, "rb") as f:
            first = f.read(1)
    except OSError as e:
        raise DecodeError(f"unreadable: {e.strerror}") from None
    if not first:
        raise DecodeError("empty file (0 bytes)")


def make_clips(video: Video, label_index: int, cfg: ClipConfig, threads: int = 1,
               timeout: float = 600) -> list[tuple[str, int, bytes]]:
    """Return ``(key, label_index, sample_bytes)`` for each clip of ``video``; everything it
    does (download, probe, decode, encode) must end within ``timeout`` seconds."""
    deadline = Deadline(timeout)
    try:
        with deadline.armed("starting"):
            return _make_clips(video, label_index, cfg, threads, deadline)
    except TimedOut as e:
        raise DecodeError(str(e)) from None


def _make_clips(video: Video, label_index: int, cfg: ClipConfig, threads: int,
                deadline: Deadline) -> list[tuple[str, int, bytes]]:
    train = video.split == "train"
    num_clips = cfg.clips_per_video if train else cfg.eval_clips
    with local_copy(video, deadline) as path:
        _check_file(video, path, deadline)
        info = decode.probe(path, deadline)
        size = decode.output_size(info, cfg.short_side)
        refs = decode.reference_frames(path, info.num_frames) if cfg.decode == "refs" else None
        picks, refs = _pick(info.num_frames, video, cfg, train, num_clips, refs)
        frames, err = decode.decode_selected(path, [i for p in picks for i in p], size, refs=refs,
                                             threads=threads, deadline=deadline)
        wanted = len({i for p in picks for i in p})
        if len(frames) < wanted:
            if err:
                raise DecodeError(f"truncated or corrupt: decoded {len(frames)} of {wanted} wanted "
                                  f"frames ({info.num_frames} declared)", err)
            # The container overstated its frame count: count by decoding, then sample again.
            info.num_frames, info.frame_count_source = decode.count_decoded_frames(path, deadline), "decoded"
            picks, refs = _pick(info.num_frames, video, cfg, train, num_clips, None)
            frames, err = decode.decode_selected(path, [i for p in picks for i in p], size,
                                                 threads=threads, deadline=deadline)
            if len(frames) < len({i for p in picks for i in p}):
                raise DecodeError("frames missing after recount", err)
    deadline.check("encoding")
    encoded = {i: jpeg.encode(f, cfg.quality) for i, f in frames.items()}
    out = []
    for clip, indices in enumerate(picks):
        key = f"{video.video_id}_c{clip:02d}"
        meta = {
            "source": video.relpath, "video": video.video_id, "split": video.split,
            "label": video.label, "class": label_index, "clip": clip, "clips": num_clips,
            "sampling": "random" if train else "centre", "frame_indices": indices,
            "reference_frames_only": refs is not None,
            "num_frames": info.num_frames, "frame_count_source": info.frame_count_source,
            "repeated_frames": info.num_frames < cfg.frames, "fps": round(info.fps, 4),
            "width": info.width, "height": info.height, "rotation": info.rotation,
            "codec": info.codec, "frame_size": list(size),
        }
        members = [(f"{t:02d}.jpg", encoded[i]) for t, i in enumerate(indices)]
        if label_index >= 0:
            members.append(("cls", str(label_index).encode()))
        members.append(("json", json.dumps(meta, sort_keys=True).encode()))
        out.append((key, label_index, sample_bytes(key, members)))
    return out


def _pick(num_frames: int, video: Video, cfg: ClipConfig, train: bool, num_clips: int,
          refs: list[int] | None) -> tuple[list[list[int]], list[int] | None]:
    """Each clip's frame indices, and the reference frames they were chosen among (None: all)."""
    picks = [sampling.clip_indices(num_frames, cfg.frames, train=train, seed=cfg.seed,
                                   video_id=video.video_id, clip=k, num_clips=num_clips, allowed=refs)
             for k in range(num_clips)]
    if refs is not None and None in picks:  # a segment without a reference frame: use every frame
        return _pick(num_frames, video, cfg, train, num_clips, None)
    return picks, refs
