"""Factory of small real media files for tests: valid videos of many kinds, and broken inputs.

Every valid video shows the same pattern: frame ``i`` is flat gray at level ``BASE + STEP * (i % PERIOD)``
with a red block in its top-left corner (to tell orientation). ``frame_index_from_image`` reads the
index back from the frame centre, so it survives lossy codecs, chroma subsampling, resizing, centre
cropping and rotation. Each ``make_*`` function writes ``path`` with the ffmpeg binary and returns it
as a ``Path``, creating parent directories; the container follows the path's extension.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import ffmpeg
import numpy as np

BASE, STEP, PERIOD = 16, 8, 30
MARKER = (255, 0, 0)
CORNERS = ("top-left", "top-right", "bottom-right", "bottom-left")


def frame_level(index: int) -> int:
    """Gray level of frame ``index`` (indices repeat every PERIOD frames)."""
    return BASE + STEP * (index % PERIOD)


def pattern_frame(index: int, width: int, height: int, texture: bool = False) -> np.ndarray:
    """The RGB frame ``index`` of every test video, shape (height, width, 3), uint8. ``texture``:
    the bottom eighth is seeded noise moving one pixel right per frame (outside what
    ``frame_index_from_image`` reads), so coded frames predict each other with real motion."""
    frame = np.full((height, width, 3), frame_level(index), np.uint8)
    frame[: max(2, height // 4), : max(2, width // 4)] = MARKER
    if texture:
        rows = max(2, height // 8)
        noise = np.random.default_rng(0).integers(0, 256, (rows, width, 3), dtype=np.uint8)
        frame[height - rows:] = np.roll(noise, index, axis=1)
    return frame


def frame_index_from_image(rgb: np.ndarray) -> int:
    """Frame index (modulo PERIOD) encoded in a decoded RGB frame, read from its central half."""
    h, w = rgb.shape[:2]
    centre = rgb[h // 4: h - h // 4, w // 4: w - w // 4].astype(np.float64)
    level = float(np.median(centre.mean(axis=2)))
    return int(np.clip(round((level - BASE) / STEP), 0, PERIOD - 1))


def marker_corner(rgb: np.ndarray) -> str:
    """Which corner of a decoded RGB frame holds the red orientation block."""
    h, w = rgb.shape[:2]
    redness = rgb[..., 0].astype(np.int32) - rgb[..., 1]
    qh, qw = max(1, h // 8), max(1, w // 8)
    patches = (redness[:qh, :qw], redness[:qh, -qw:], redness[-qh:, -qw:], redness[-qh:, :qw])
    return CORNERS[int(np.argmax([p.mean() for p in patches]))]


_PPM_HEADER = re.compile(rb"P6\s+(\d+)\s+(\d+)\s+255\s")


def decode_frames(path) -> np.ndarray:
    """Every decoded frame once, as the ffmpeg CLI decodes it (rotation applied), shape (n, h, w, 3).
    ``fps_mode passthrough`` matters: by default ffmpeg duplicates frames of VFR input into a pipe."""
    out, _ = (ffmpeg.input(str(path)).output("pipe:", format="image2pipe", vcodec="ppm",
                                             fps_mode="passthrough")
              .global_args("-hide_banner", "-loglevel", "error").run(capture_stdout=True,
                                                                     capture_stderr=True))
    frames, offset = [], 0
    while offset < len(out):
        header = _PPM_HEADER.match(out, offset)
        width, height = int(header[1]), int(header[2])
        offset = header.end() + width * height * 3
        frames.append(np.frombuffer(out[header.end():offset], np.uint8).reshape(height, width, 3))
    return np.stack(frames)


def reference_frame_indices(path, fps: float) -> list[int]:
    """Display indices (from timestamps: constant frame rate only) of the frames ffmpeg still
    decodes with ``-skip_frame noref``, that is, of the reference frames."""
    _, err = (ffmpeg.input(str(path), skip_frame="noref").filter("showinfo").output("-", format="null")
              .global_args("-hide_banner").run(capture_stdout=True, capture_stderr=True))
    return sorted(round(float(t) * fps) for t in re.findall(rb"pts_time:([0-9.]+)", err))


def _target(path) -> Path:
    """``path`` as a Path, its parent directories created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _run(stream, stdin: bytes | None = None) -> None:
    stream.global_args("-hide_banner", "-loglevel", "error").overwrite_output().run(
        input=stdin, capture_stdout=True, capture_stderr=True)


def make_video(path, *, frames: int = 20, width: int = 64, height: int = 48, fps: float = 10,
               codec: str = "libx264", pix_fmt: str = "yuv420p", extra_output_args: dict | None = None,
               texture: bool = False) -> Path:
    """Encode ``frames`` pattern frames. ``extra_output_args`` are ffmpeg-python output keywords
    (``{"vf": "setsar=2", "tag:v": "hvc1"}`` becomes ``-vf setsar=2 -tag:v hvc1``)."""
    path = _target(path)
    raw = b"".join(pattern_frame(i, width, height, texture).tobytes() for i in range(frames))
    stream = (ffmpeg.input("pipe:", format="rawvideo", pix_fmt="rgb24", s=f"{width}x{height}", framerate=fps)
              .output(str(path), vcodec=codec, pix_fmt=pix_fmt, **(extra_output_args or {})))
    _run(stream, raw)
    return path


# --- broken inputs ---------------------------------------------------------------------------------

def make_zero_byte(path) -> Path:
    path = _target(path)
    path.write_bytes(b"")
    return path


def _top_level_boxes(data: bytes) -> dict[bytes, tuple[int, int]]:
    """ISO-BMFF top-level boxes: type -> (offset, size). Enough for files ffmpeg writes here."""
    boxes, offset = {}, 0
    while offset + 8 <= len(data):
        size = int.from_bytes(data[offset: offset + 4], "big")
        kind = data[offset + 4: offset + 8]
        if size == 1:
            size = int.from_bytes(data[offset + 8: offset + 16], "big")
        boxes[kind] = (offset, size)
        offset += size
    return boxes


def make_truncated(path, *, faststart: bool = True) -> Path:
    """A 30-frame h264 mp4 cut short, like an interrupted download. ``faststart=True``: moov first,
    cut at the start of the 15th packet in mdat (headers parse, about half the frames decode).
    ``faststart=False``: moov last, cut where it starts (the samples are there, their index is not)."""
    path = _target(path)
    make_video(path, frames=30, extra_output_args={"movflags": "+faststart"} if faststart else None)
    data = path.read_bytes()
    boxes = _top_level_boxes(data)
    mdat, moov = boxes[b"mdat"][0], boxes[b"moov"][0]
    assert (moov < mdat) == faststart, boxes
    if faststart:
        packets = ffmpeg.probe(str(path), show_packets=None, select_streams="v")["packets"]
        cut = sorted(int(p["pos"]) for p in packets)[len(packets) // 2]
    else:
        cut = moov
    path.write_bytes(data[:cut])
    return path


def make_not_a_video(path, *, kind: str = "text") -> Path:
    """``kind="text"``: a short text file; ``kind="random"``: 4 KiB of seeded random bytes."""
    path = _target(path)
    if kind == "text":
        path.write_text("this is not a video\n")
    elif kind == "random":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    else:
        raise ValueError(f"kind must be 'text' or 'random', got {kind!r}")
    return path


def make_audio_only(path) -> Path:
    """An mp4 with a single AAC audio stream (half a second of sine) and no video stream."""
    path = _target(path)
    _run(ffmpeg.input("sine=frequency=440:duration=0.5", format="lavfi").output(str(path), acodec="aac"))
    return path


def make_unreadable(path) -> Path:
    """A name that is listed but cannot be opened. Tests run as root, where permission bits do not
    stop reads, so this is a dangling symlink: ``open()`` raises FileNotFoundError."""
    path = _target(path)
    os.symlink(path.name + ".missing-target", path)
    return path


def make_named_pipe(path) -> Path:
    """A FIFO named like a video: opening it for reading blocks until a writer comes, and reading
    blocks until the writer writes."""
    path = _target(path)
    os.mkfifo(path)
    return path


def make_directory_named_like_video(path) -> Path:
    path = _target(path)
    path.mkdir()
    return path


# --- hard but valid inputs -------------------------------------------------------------------------

def make_few_frames(path, *, frames: int = 3) -> Path:
    return make_video(path, frames=frames)


def make_high_res(path, *, width: int = 3840, height: int = 2160, frames: int = 5) -> Path:
    return make_video(path, frames=frames, width=width, height=height,
                      extra_output_args={"preset": "ultrafast"})


def make_vp9_webm(path) -> Path:
    return make_video(path, codec="libvpx-vp9",
                      extra_output_args={"format": "webm", "deadline": "realtime", "cpu-used": 8})


def make_hevc_mp4(path) -> Path:
    return make_video(path, codec="libx265", extra_output_args={"format": "mp4", "tag:v": "hvc1",
                                                             "x265-params": "log-level=error"})


def make_mpeg4_avi(path) -> Path:
    """MPEG-4 Part 2 in AVI (fixed quantiser: the default bitrate smears the flat levels)."""
    return make_video(path, codec="mpeg4", extra_output_args={"format": "avi", "q:v": 2})


def make_mkv(path) -> Path:
    return make_video(path, extra_output_args={"format": "matroska"})


def make_yuv444(path) -> Path:
    """h264 High 4:4:4 Predictive (yuv444p): decoders without 4:4:4 support reject it."""
    return make_video(path, pix_fmt="yuv444p")


def make_vfr(path, *, frames: int = 20, fps: float = 10) -> Path:
    """Variable frame rate: the first half at ``fps``, the second half at ``fps / 2`` (each frame
    lasts twice as long), timestamps kept as they are (``-fps_mode vfr``)."""
    half = frames // 2
    return make_video(path, frames=frames, fps=fps, extra_output_args={
        "vf": f"setpts='if(lt(N,{half}),N,2*N-{half})/({fps}*TB)'", "fps_mode": "vfr"})


def make_rotated(path, *, degrees: int = 90) -> Path:
    """h264 mp4 to be shown turned ``degrees`` clockwise, as a phone held upright records it: ffprobe
    reports display-matrix rotation ``-degrees`` and an autorotating decoder (the ffmpeg CLI) returns
    portrait frames with the marker top-right. ffmpeg 5.1 ignores the ``rotate`` tag when encoding
    and reads it as counter-clockwise degrees when stream-copying, hence the remux with ``-degrees``."""
    path = _target(path)
    plain = make_video(path.with_name(path.name + ".plain.mp4"))
    _run(ffmpeg.input(str(plain)).output(str(path), c="copy", **{"metadata:s:v:0": f"rotate={-degrees}"}))
    plain.unlink()
    return path


def make_edit_list(path, *, frames: int = 48, cut: float = 1.3, keep: float | None = None, **kwargs) -> Path:
    """A file cut without re-encoding, as ``ffmpeg -ss CUT -i IN -c copy`` does: it keeps the
    frames from the key frame before ``cut`` for their references, and an edit list hides them.
    The header lists every sample; fewer frames display (the first shown is frame ``cut * fps``)."""
    path = _target(path)
    whole = make_video(path.with_name(path.name + ".whole" + path.suffix), frames=frames, **kwargs)
    _run(ffmpeg.input(str(whole), ss=cut).output(str(path), c="copy", **({"t": keep} if keep else {})))
    whole.unlink()
    return path


def make_anamorphic(path) -> Path:
    """Sample aspect ratio 2:1: 64x48 coded, 128x48 (8:3) displayed."""
    return make_video(path, extra_output_args={"vf": "setsar=2"})


def make_class_folders(root, frames: int = 16, width: int = 40, height: int = 30):
    """A tiny Kinetics-style source under ``root``: classes jump and walk, two train videos and
    one val video each; returns ``root``."""
    for label in ("jump", "walk"):
        make_video(root / "val" / label / f"{label}.mp4", frames=frames, width=width, height=height)
        for i in range(2):
            make_video(root / "train" / label / f"{label}{i}.mp4", frames=frames, width=width, height=height)
    return root
