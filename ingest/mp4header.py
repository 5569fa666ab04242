"""Reading an MP4/MOV video track's header in-process, without starting ffprobe.

Starting the ffprobe binary costs about as much as decoding a short low-resolution clip, and
Kinetics is almost all MP4, so for MP4/MOV files the few facts sampling needs (frame count, size,
sample aspect ratio, rotation, frame rate, codec) are read from the ``moov`` box directly. Any
file this reader does not fully understand returns ``None`` and goes to ffprobe instead.

The frame count is what the file displays: with an edit list (a file cut without re-encoding
keeps the frames before the cut for their references and hides them), only the samples whose
presentation time falls inside the edit count, not every sample of the track.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import BinaryIO

CONTAINERS = {b"moov", b"trak", b"edts", b"mdia", b"minf", b"stbl"}
TABLES = {b"stts", b"ctts", b"elst"}  # read whole, on demand
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
    edited: bool = False  # the edit list hides some samples: num_frames counts the shown ones


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


def _movie_timescale(f: BinaryIO, start: int, end: int) -> int:
    for kind, s, e in _boxes(f, start, end):
        if kind == b"mvhd":
            f.seek(s)
            body = f.read(32)
            return struct.unpack(">I", body[12:16] if body[0] == 0 else body[20:24])[0]
    return 0


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
        if kind in TABLES:
            out.setdefault("tables", {})[kind] = (s, e)
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


def _entry_box(f: BinaryIO, span, kind: bytes) -> bytes | None:
    """The body of box ``kind`` inside the sample description entry (``pasp``, ``avcC``, ...)."""
    for k, s, e in _boxes(f, *span):
        if k == kind:
            f.seek(s)
            return f.read(min(e - s, 4096))
    return None


def _sar(f: BinaryIO, span) -> float:
    body = _entry_box(f, span, b"pasp")
    if body and len(body) >= 8:
        h, v = struct.unpack(">II", body[:8])
        return h / v if h and v else 1.0
    return 1.0


def read(path: str) -> Mp4Video | None:
    """The first video track's header facts, or None when ffprobe should be asked instead."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            moov = _find_moov(f, f.tell())
            track = moov and _video_track(f, *moov)
            need = ("matrix", "timescale", "duration", "fourcc", "size", "frames")
            if not track or any(k not in track for k in need) or track["fourcc"] not in CODECS:
                return None
            if not track["frames"] or not track["timescale"] or not all(track["size"]):
                return None
            frames = _displayed_frames(f, track, _movie_timescale(f, *moov))
            if frames is None:
                return None
            a, b = track["matrix"][0], track["matrix"][1]
            rotation = round(-math.degrees(math.atan2(b, a))) % 360
            seconds = track["duration"] / track["timescale"]
            return Mp4Video(width=track["size"][0], height=track["size"][1], sar=_sar(f, track["entry_boxes"]),
                            rotation=rotation, num_frames=frames,
                            fps=track["frames"] / seconds if seconds else 0.0, duration=seconds,
                            codec=CODECS[track["fourcc"]], edited=frames != track["frames"])
    except (OSError, struct.error, IndexError, ValueError):
        return None


def _table(f: BinaryIO, span, fmt: str, header: int = 8) -> list[tuple]:
    """Entries of a full-box table: a 4-byte version/flags, an entry count, then the entries."""
    f.seek(span[0])
    body = f.read(span[1] - span[0])
    count = struct.unpack(">I", body[header - 4:header])[0]
    size = struct.calcsize(fmt)
    return [struct.unpack_from(fmt, body, header + i * size) for i in range(count)]


def _displayed_frames(f: BinaryIO, track: dict, movie_timescale: int) -> int | None:
    """Samples whose presentation time lies inside the track's edit (all of them without an edit
    list); None for edit lists this reader does not model (several edits, rates other than 1)."""
    tables = track.get("tables", {})
    if b"elst" not in tables:
        return track["frames"]
    f.seek(tables[b"elst"][0])
    version = f.read(1)[0]
    fmt = ">Iihh" if version == 0 else ">Qqhh"
    edits = [e for e in _table(f, tables[b"elst"], fmt) if e[1] != -1]  # empty edits only delay
    if len(edits) != 1 or edits[0][2] != 1 or not movie_timescale or b"stts" not in tables:
        return None
    duration, start = edits[0][0], edits[0][1]
    end = start + duration * track["timescale"] / movie_timescale if duration else math.inf
    dts, pts = 0, []
    for count, delta in _table(f, tables[b"stts"], ">II"):
        for _ in range(count):
            pts.append(dts)
            dts += delta
    if b"ctts" in tables:
        # signed whatever the box version says, as FFmpeg reads it
        shifts = [shift for n, shift in _table(f, tables[b"ctts"], ">Ii") for _ in range(n)]
        if len(shifts) != len(pts):
            return None
        pts = [t + d for t, d in zip(pts, shifts)]
    if len(pts) != track["frames"]:
        return None
    return sum(1 for t in pts if start <= t < end)
