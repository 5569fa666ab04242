"""Decoding one video with the ffprobe and ffmpeg binaries: the fallback for what the in-process
decoder (``pyav_decoder``) cannot open, and its reference in tests.

``probe`` reads the stream header once (in-process from an MP4's ``moov`` box, else ffprobe);
``decode_selected`` decodes the video once and lets through only the wanted frame indices
(ffmpeg's ``select`` filter on the displayed frame number), scaled to the output size, as raw
RGB. Rotation stored in the file is applied by ffmpeg's autorotation before the filters, and a
non-square sample aspect ratio is undone by scaling to the display size. Every call runs under
the video's ``Deadline``: the binaries are killed when it passes.
"""
from __future__ import annotations

import json
import re
import subprocess
from fractions import Fraction
from typing import Callable

import ffmpeg
import numpy as np
from PIL import Image

from . import mp4header
from .deadline import Deadline, TimedOut
from .video import Decoded, DecodeError, VideoInfo, display_size, output_size


def _tail(raw: bytes) -> str:
    """ffmpeg's last lines, without the per-run pointers (``[h264 @ 0x55d1...]``)."""
    text = re.sub(r" @ 0x[0-9a-f]+\]", "]", raw.decode("utf-8", "replace"))
    return " | ".join(l.strip() for l in text.strip().splitlines()[-4:])


def _run(args: list[str], deadline: Deadline, step: str) -> subprocess.CompletedProcess:
    """Run a binary, killed at the deadline (``subprocess.run`` kills it on any exception too)."""
    try:
        return subprocess.run(args, capture_output=True, stdin=subprocess.DEVNULL,
                              timeout=deadline.remaining(step))
    except subprocess.TimeoutExpired:
        raise TimedOut(deadline.seconds, step) from None


def demux_messages(path: str, deadline: Deadline) -> str:
    """What ffmpeg says reading ``path``'s video to the end, decoding only key frames: the ledger's
    words for a video the in-process decoder refused without a message of FFmpeg's own."""
    p = _run(["ffmpeg", "-nostdin", "-hide_banner", "-v", "error", "-skip_frame", "nokey", "-i", path,
              "-map", "0:v:0?", "-f", "null", "-"], deadline, "reading packets")
    return _tail(p.stderr)


def ffprobe(path: str, deadline: Deadline, *args: str, step: str = "probing") -> dict:
    """ffprobe's JSON for ``path`` (``args``: more ffprobe options); DecodeError if it fails."""
    p = _run(["ffprobe", "-v", "error", "-of", "json", *args, path], deadline, step)
    if p.returncode != 0:
        raise DecodeError("not a readable video" if step == "probing" else "cannot count frames",
                          _tail(p.stderr))
    return json.loads(p.stdout or b"{}")


def rotation(stream: dict) -> int:
    """Counter-clockwise degrees (mod 360) of an ffprobe stream's display matrix or rotate tag."""
    for sd in stream.get("side_data_list", []) or []:
        if "rotation" in sd:
            return int(round(float(sd["rotation"]))) % 360
    rot = stream.get("tags", {}).get("rotate")
    # A display matrix's rotation is counter-clockwise; the legacy tag is clockwise.
    return (-int(rot)) % 360 if rot else 0


def _fraction(text: str | None) -> Fraction:
    try:
        return Fraction((text or "0").replace(":", "/"))
    except (ValueError, ZeroDivisionError):
        return Fraction(0)


def probe(path: str, deadline: Deadline) -> VideoInfo:
    """Header facts of the first video stream: from the MP4 header when it can be read in-process
    (frames counted inside the edit list), else from ffprobe (with a demux-only packet count when
    the container stores no frame count)."""
    if path.lower().endswith((".mp4", ".m4v", ".mov")):
        head = mp4header.read(path)
        if head:
            w, h = display_size(head.width, head.height, head.sar, head.rotation)
            return VideoInfo(w, h, head.width, head.height, head.rotation, head.fps, head.num_frames,
                             "edit list" if head.edited else "container", head.codec, head.duration)
    meta = ffprobe(path, deadline, "-show_format", "-show_streams")
    videos = [s for s in meta.get("streams", []) if s.get("codec_type") == "video"
              and not s.get("disposition", {}).get("attached_pic")]
    if not videos:
        kinds = sorted({s.get("codec_type", "?") for s in meta.get("streams", [])}) or ["none"]
        raise DecodeError(f"no video stream (streams: {', '.join(kinds)})")
    s = videos[0]
    w, h = int(s.get("width") or 0), int(s.get("height") or 0)
    if w <= 0 or h <= 0:
        raise DecodeError("video stream has no frame size", s.get("codec_name", ""))
    rot = rotation(s)
    dw, dh = display_size(w, h, _fraction(s.get("sample_aspect_ratio")), rot)
    fps = _fraction(s.get("avg_frame_rate")) or _fraction(s.get("r_frame_rate"))
    duration = float(s.get("duration") or meta.get("format", {}).get("duration") or 0)
    frames, source = int(s.get("nb_frames") or 0), "container"
    if frames <= 0:
        frames, source = _count_packets(path, deadline), "packets"
    if frames <= 0:
        raise DecodeError("video stream has no frames")
    return VideoInfo(dw, dh, w, h, rot, float(fps), frames, source, s.get("codec_name", "?"), duration)


def _count_packets(path: str, deadline: Deadline) -> int:
    """Frame count from demuxing alone (no decoding), for containers that do not store it."""
    meta = ffprobe(path, deadline, "-count_packets", "-select_streams", "v:0", "-show_streams",
                   step="counting packets")
    streams = meta.get("streams") or [{}]
    return int(streams[0].get("nb_read_packets") or 0)


def decode_selected(path: str, indices: list[int], size: tuple[int, int], *, threads: int = 1,
                    deadline: Deadline) -> tuple[dict[int, np.ndarray], str]:
    """Decode the video once, returning {frame index: HxWx3 uint8} for the indices found.

    Frames past the real end are silently absent (ffmpeg drops them): callers count what came
    back. Also returns ffmpeg's error output, empty when clean.
    """
    wanted = sorted(set(indices))
    w, h = size
    expr = "+".join(f"eq(n,{i})" for i in wanted)  # ffmpeg-python escapes the commas
    graph = (
        ffmpeg.input(path, threads=threads)
        .video.filter("select", expr)
        .filter("scale", w, h, flags="area")
        .output("pipe:", format="rawvideo", pix_fmt="rgb24", fps_mode="passthrough",
                **{"frames:v": len(wanted), "threads": threads})
    )
    args = ffmpeg.compile(graph, cmd="ffmpeg", overwrite_output=True)
    args[1:1] = ["-nostdin", "-hide_banner", "-v", "error"]
    p = _run(args, deadline, "decoding")
    err = _tail(p.stderr)
    frame_bytes = w * h * 3
    n = len(p.stdout) // frame_bytes
    if p.returncode != 0 and n == 0:
        raise DecodeError("ffmpeg failed to decode", err)
    data = np.frombuffer(p.stdout[: n * frame_bytes], np.uint8).reshape(n, h, w, 3)
    return {idx: data[k] for k, idx in enumerate(wanted[:n])}, err


def count_decoded_frames(path: str, deadline: Deadline) -> int:
    """Frame count by decoding the whole stream: the slow, exact fallback."""
    meta = ffprobe(path, deadline, "-count_frames", "-select_streams", "v:0", "-show_streams",
                   step="counting frames")
    streams = meta.get("streams") or [{}]
    return int(streams[0].get("nb_read_frames") or 0)


def decode(path: str, wanted: Callable[[int], list[int]], short_side: int, *, threads: int = 1,
           deadline: Deadline, motion_vectors: bool = False) -> Decoded:
    """The frames ``wanted(frame count)`` (display indices) of ``path``, scaled and upright; the
    command line exports no motion vectors, whatever ``motion_vectors`` asks (``clips.warnings``
    says so in the ledger)."""
    info = probe(path, deadline)
    size = output_size(info, short_side)
    indices = sorted(set(wanted(info.num_frames)))
    arrays, err = decode_selected(path, indices, size, threads=threads, deadline=deadline)
    if len(arrays) < len(indices):
        if err:
            raise DecodeError(f"truncated or corrupt: decoded {len(arrays)} of {len(indices)} wanted "
                              f"frames ({info.num_frames} declared)", err)
        # The container overstated its frame count: count by decoding, then sample again.
        info.num_frames, info.frame_count_source = count_decoded_frames(path, deadline), "decoded"
        if not info.num_frames:  # a header listing frames none of which decodes (an edit showing none)
            raise DecodeError("no frame decodes", err)
        indices = sorted(set(wanted(info.num_frames)))
        arrays, err = decode_selected(path, indices, size, threads=threads, deadline=deadline)
        if len(arrays) < len(indices):
            raise DecodeError("frames missing after recount", err)
    frames = {i: Image.fromarray(a, "RGB") for i, a in arrays.items()}
    return Decoded(info, frames, "ffmpeg", detail=err)
