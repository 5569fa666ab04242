"""One video in, its pre-sampled clips out, as WebDataset sample bytes (runs in the workers).

The video is decoded once for the union of the frames all its clips keep, by the decoder
``ClipConfig.decoder`` names in ``ingest.decode.DECODERS``: in-process with PyAV (only the packets
those frames need), falling back to the ffmpeg command line for what PyAV cannot open, or with
``decoder="ffmpeg"`` the command line for every video. Each clip becomes one
sample as ``shards.format.sample`` defines it (T JPEG frames in temporal order, the label, the
metadata, and with a ``motion`` other than ``"none"`` each frame's motion field, made by
``ingest.decode.motion``).
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import fsspec
import numpy as np
from fsspec.core import url_to_fs

from shards.format import motionfield, sample
from shards.io import storage

from . import bounds, decode, jpeg, sampling
from .decode import DECODERS, motion
from .decode.deadline import Deadline, TimedOut
from .decode.video import Decoded, DecodeError
from .sources import Video


@dataclass(frozen=True)
class ClipConfig:
    """Everything that decides a sample's bytes (and so goes into the manifest's config)."""
    frames: int = 8
    clips_per_video: int = 1  # training split
    eval_clips: int = 1  # val/test splits: evenly spread centre offsets
    short_side: int = 256
    quality: int = 90
    restart_interval: int = 1  # MCUs between JPEG restart markers (ingest.jpeg); 0: none
    seed: int = 0
    decoder: str = "pyav"  # "ffmpeg": the command line for every video (the reference, and slower)
    motion: str = "none"  # "mv": the codec's motion vectors; "flow": optical flow (ingest.decode.motion)
    refuse_short: bool = False  # a video of fewer frames than ``frames`` (a still) fails instead of a warning

    def __post_init__(self):
        for option in ("frames", "clips_per_video", "eval_clips", "short_side", "quality", "restart_interval",
                       "seed"):
            bounds.check(option, getattr(self, option))
        if self.motion not in motion.MOTIONS:
            raise ValueError(f"motion must be one of {motion.MOTIONS}, not {self.motion!r}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {tuple(DECODERS)}, not {self.decoder!r}")
        if self.motion == "mv" and not DECODERS[self.decoder].motion_vectors:
            exporting = " or ".join(repr(name) for name, d in DECODERS.items() if d.motion_vectors)
            raise ValueError(f"motion 'mv' needs decoder {exporting} "
                             f"({self.decoder!r} does not export motion vectors)")

    def as_dict(self) -> dict:
        """The config as recorded; options at their defaults since they were added left out, as
        before they existed (the same ids and keys)."""
        d = asdict(self)
        for key, since in (("motion", "none"), ("refuse_short", False)):
            if d[key] == since:
                del d[key]
        return d


@contextmanager
def local_copy(video: Video, deadline: Deadline):
    """A local path to the video: itself if local, else a temporary download
    (ffmpeg cannot seek in a pipe, and most mp4s keep their index at the end)."""
    local = storage.local_path(video.url)
    if local is not None:
        yield local
        return
    deadline.check("downloading")  # before fsspec sets up its remote filesystem, which takes time too
    tmpdir = tempfile.mkdtemp(prefix="ingest-")
    path = os.path.join(tmpdir, "video" + os.path.splitext(video.relpath)[1])
    try:
        with fsspec.open(video.url, "rb") as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        yield path
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _check_file(video: Video, path: str, deadline: Deadline) -> None:
    deadline.check("opening")
    if video.kind == "directory":
        raise DecodeError("is a directory, not a video file")
    if video.kind == "dangling":
        raise DecodeError("not a regular file: a symbolic link to nothing")
    if video.kind != "file":
        raise DecodeError("not a regular file: a named pipe, socket or device")
    try:
        with open(path, "rb") as f:
            first = f.read(1)
    except OSError as e:
        raise DecodeError(f"unreadable: {e.strerror}") from None
    if not first:
        raise DecodeError("empty file (0 bytes)")


def make_clips(video: Video, label_index: int, cfg: ClipConfig, threads: int = 1,
               timeout: float = 600) -> tuple[list[tuple[str, int, bytes]], list[tuple[str, str]]]:
    """``(key, label_index, sample_bytes)`` for each clip of ``video``, and the video's warnings
    (``warnings``: what its clips are not, as ``(code, reason)``); everything it does (download,
    probe, decode, encode) must end within ``timeout`` seconds."""
    if storage.local_path(video.url) is None:
        url_to_fs(video.url)  # sets up (and caches) the remote filesystem: our start-up, not the input's time
    deadline = Deadline(timeout)
    try:
        with deadline.armed("starting"):
            return _make_clips(video, label_index, cfg, threads, deadline)
    except TimedOut as e:
        raise DecodeError(str(e)) from None


def _make_clips(video: Video, label_index: int, cfg: ClipConfig, threads: int,
                deadline: Deadline) -> tuple[list[tuple[str, int, bytes]], list[tuple[str, str]]]:
    train = video.split == "train"
    num_clips = cfg.clips_per_video if train else cfg.eval_clips

    @functools.cache  # asked three times a video; a seeded generator costs as much as a JPEG
    def picks(num_frames: int) -> list[list[int]]:
        return [sampling.clip_indices(num_frames, cfg.frames, train=train, seed=cfg.seed,
                                      video_id=video.video_id, clip=k, num_clips=num_clips)
                for k in range(num_clips)]

    def wanted(num_frames: int) -> list[int]:
        kept = [i for p in picks(num_frames) for i in p]
        return motion.with_previous(kept) if cfg.motion == "flow" else kept

    with local_copy(video, deadline) as path:
        _check_file(video, path, deadline)
        decoded = decode.decode(cfg.decoder, path, wanted, cfg.short_side, threads=threads, deadline=deadline,
                                motion_vectors=cfg.motion == "mv")
    info = decoded.info
    found = warnings(decoded, cfg)
    if cfg.refuse_short and found and found[0][0] in SHORT:
        raise DecodeError(f"too short: {found[0][1]} (--refuse-short-videos)")
    deadline.check("encoding")
    kept = {i for p in picks(info.num_frames) for i in p}
    encoded = {i: jpeg.encode(decoded.frames[i], cfg.quality, cfg.restart_interval) for i in sorted(kept)}
    fields = {} if cfg.motion == "none" else {i: motionfield.encode(*_field(decoded, i, cfg.motion))
                                                for i in sorted(kept)}
    out = []
    for clip, indices in enumerate(picks(info.num_frames)):
        key = sample.clip_key(video.video_id, clip)
        meta = {
            "source": video.relpath, "video": video.video_id, "split": video.split,
            "label": video.label, "class": label_index, "clip": clip, "clips": num_clips,
            "sampling": "random" if train else "centre", "frame_indices": indices,
            "num_frames": info.num_frames, "frame_count_source": info.frame_count_source,
            "repeated_frames": info.num_frames < cfg.frames, "fps": round(info.fps, 4),
            "width": info.width, "height": info.height, "rotation": info.rotation,
            "codec": info.codec, "frame_size": list(decoded.frames[indices[0]].size),
            "decoder": decoded.decoder, "packets_decoded": decoded.packets_decoded,
        }
        out.append((key, label_index,
                    sample.pack(key, [encoded[i] for i in indices], label_index, meta,
                                [fields[i] for i in indices] if fields else [], cfg.motion)))
    return out, found


SHORT = ("still image", "few frames")  # the warnings --refuse-short-videos makes failures


def warnings(decoded: Decoded, cfg: ClipConfig) -> list[tuple[str, str]]:
    """What a decoded video's clips will not be, as ``(code, reason)``: the build's ledger records
    each as a warning, and counts them (short ones first, for ``refuse_short``). A still image (a
    PNG renamed .mp4, a 1-frame video) or fewer frames than a clip's: frames repeated in every
    clip. A video smaller than ``short_side``: kept at its own size (``video.output_size``).
    ``motion="mv"`` from a decoder that exports no vectors: fields all unknown."""
    info, found = decoded.info, []
    if info.num_frames == 1:
        found.append(("still image", f"1 frame ({info.codec}): every clip repeats it {cfg.frames} times"))
    elif info.num_frames < cfg.frames:
        found.append(("few frames", f"{info.num_frames} frames, fewer than --frames {cfg.frames}: each clip "
                                    "repeats some"))
    if min(info.width, info.height) < cfg.short_side:
        found.append(("small", f"{info.width}x{info.height}, smaller than --short-side {cfg.short_side}: "
                               "stored at its own size, not upscaled"))
    exports = DECODERS[decoded.decoder].motion_vectors
    if cfg.motion == "mv" and (not exports or info.codec not in motion.VECTOR_CODECS):
        why = (f"the {info.codec} decoder exports none" if exports
               else f"decoded by {decoded.decoder!r}, which exports none")
        found.append(("no motion vectors", f"{why}: its motion fields are all unknown; --motion flow "
                                           "computes them from the frames"))
    return found


def _field(decoded: Decoded, i: int, kind: str):
    """(field, valid) of kept frame ``i``: from the decoder's motion vectors (none from the
    command line: invalid), or the flow from the frame before it (none before frame 0)."""
    size = decoded.frames[i].size
    if kind == "mv":
        return decoded.motion.get(i) or motion.nothing(*size)
    if i == 0:
        return motion.nothing(*size)
    return motion.flow(np.asarray(decoded.frames[i - 1]), np.asarray(decoded.frames[i]))
