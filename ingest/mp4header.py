"""Reading an MP4/MOV video track's header in-process, without starting ffprobe.

Starting the ffprobe binary costs about as much as decoding a short low-resolution clip, and
Kinetics is almost all MP4, so for MP4/MOV files the few facts sampling needs (frame count, size,
sample aspect ratio, rotation, frame rate, codec) are read from the ``moov`` box directly. Any
file this reader does not fully understand returns ``None`` and goes to ffprobe instead.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import BinaryIO

CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl"}
CODECS = {b"avc1": "h264", b"avc3": "h264", b"hvc1": "hevc", b"hev1": "hevc", b"mp4v": "mpeg4",
          b"vp09": "vp9", b"av01": "av1", b"mjpa": "mjpeg", b"jpeg": "mjpeg"}


@dataclass
class Mp4Video:
    width: int
    height: int
    sar: float
    rotation: int  # counter-clockwise degrees, as ffprobe reports the display matrix, mod 360
    num_frames: int
    fps: float
    duration: float
    codec: str


def _boxes(f: BinaryIO, start: int, end: int):
    pos = start
    while pos + 8 <= end:
        f.seek(pos)
        head = f.read(8)
        if len(head) < 8:
            return
        size, kind = struct.unpack(">I4s", head)
        hdr = 8
        if size == 1:
            size, hdr = struct.unpack(">Q", f.read(8))[0], 16
        elif size == 0:
            size = end - pos
        if size < hdr or pos + size > end:
            return
        yield kind, pos + hdr, pos + size
        pos += size


def _find_moov(f: BinaryIO, file_size: int):
    for kind, start, end in _boxes(f, 0, file_size):
        if kind == b"moov":
            return start, end
    return None


def _video_track(f: BinaryIO, start: int, end: int) -> dict | None:
    for kind, s, e in _boxes(f, start, end):
        if kind != b"trak":
            continue
        found = {}
        _collect(f, s, e, found)
        if found.get("handler") == b"vide":
            return found
    return None


def _collect(f: BinaryIO, start: int, end: int, out: dict) -> None:
    for kind, s, e in _boxes(f, start, end):
        if kind in CONTAINERS:
            _collect(f, s, e, out)
            continue
        f.seek(s)
        body = f.read(min(e - s, 4096))
        if kind == b"tkhd":
            matrix_at = 40 if body[0] == 0 else 52
            out["matrix"] = struct.unpack(">9i", body[matrix_at:matrix_at + 36])
            out["tk_size"] = struct.unpack(">II", body[matrix_at + 36:matrix_at + 44])
        elif kind == b"mdhd":
            out["timescale"], out["duration"] = (struct.unpack(">II", body[12:20]) if body[0] == 0
                                                 else struct.unpack(">IQ", body[20:32]))
        elif kind == b"hdlr":
            out["handler"] = body[8:12]
        elif kind == b"stsd" and len(body) >= 16 + 78:
            entry = body[8:]
            out["fourcc"] = entry[4:8]
            out["size"] = struct.unpack(">HH", entry[32:36])
            out["entry_boxes"] = (s + 8 + 86, s + 8 + struct.unpack(">I", entry[:4])[0])
        elif kind == b"stsz":
            out["frames"] = struct.unpack(">I", body[8:12])[0]
        elif kind == b"stz2":
            out["frames"] = struct.unpack(">I", body[8:12])[0]
        elif kind == b"elst":
            out["edits"] = struct.unpack(">I", body[4:8])[0]


def _sar(f: BinaryIO, span) -> float:
    for kind, s, _ in _boxes(f, *span):
        if kind == b"pasp":
            f.seek(s)
            h, v = struct.unpack(">II", f.read(8))
            return h / v if h and v else 1.0
    return 1.0


def read(path: str) -> Mp4Video | None:
    """The first video track's header facts, or None when ffprobe should be asked instead."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            moov = _find_moov(f, f.tell())
            track = moov and _video_track(f, *moov)
            if not track or track.get("edits", 1) > 1:  # several edits can drop or repeat frames
                return None
            need = ("matrix", "timescale", "duration", "fourcc", "size", "frames")
            if any(k not in track for k in need) or track["fourcc"] not in CODECS:
                return None
            if not track["frames"] or not track["timescale"] or not all(track["size"]):
                return None
            a, b = track["matrix"][0], track["matrix"][1]
            rotation = round(-math.degrees(math.atan2(b, a))) % 360
            seconds = track["duration"] / track["timescale"]
            return Mp4Video(width=track["size"][0], height=track["size"][1], sar=_sar(f, track["entry_boxes"]),
                            rotation=rotation, num_frames=track["frames"],
                            fps=track["frames"] / seconds if seconds else 0.0, duration=seconds,
                            codec=CODECS[track["fourcc"]])
    except (OSError, struct.error, IndexError, ValueError):
        return None
