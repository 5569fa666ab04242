"""Reading an MP4/MOV video track's header in-process, without starting ffprobe.

Starting the ffprobe binary costs about as much as decoding a short low-resolution clip, and
Kinetics is almost all MP4, so for MP4/MOV files the few facts sampling needs (frame count, size,
sample aspect ratio, rotation, frame rate, codec) are read from the ``moov`` box directly. Any
file this reader does not fully understand returns ``None`` and goes to ffprobe instead.

The frame count is what the file displays: with an edit list (a file cut without re-encoding
keeps the frames before the cut for their references and hides them), only the samples whose
presentation time falls inside the edit count, not every sample of the track. They are counted
run by run of the time tables (``stts``, ``ctts``), never sample by sample, so a run that claims
2^32 samples costs what a run of one does.

The bytes are untrusted (``tests/test_video_fuzz.py`` mutates real files): every size, count and
offset is checked against the box that holds it before it is used, boxes nested deeper than any
file nests them, tables larger than their box, a sample entry running past its box, more samples
than the file has bytes and an edit showing no frame are each a reason (logged at debug level)
to leave the file to ffprobe.
"""
from __future__ import annotations

import itertools
import logging
import math
import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import BinaryIO, Iterator

CONTAINERS = {b"moov", b"trak", b"edts", b"mdia", b"minf", b"stbl"}
TABLES = {b"stts", b"ctts", b"elst"}  # read whole, on demand
CODECS = {b"avc1": "h264", b"avc3": "h264", b"hvc1": "hevc", b"hev1": "hevc", b"mp4v": "mpeg4",
          b"vp09": "vp9", b"av01": "av1", b"mjpa": "mjpeg", b"jpeg": "mjpeg"}
MAX_DEPTH = 8  # moov/trak/mdia/minf/stbl is 5 deep: deeper is not a file this reader knows
log = logging.getLogger("ingest.decode.mp4header")


class Unreadable(ValueError):
    """What this reader will not take from the file (ffprobe is asked instead)."""


@dataclass
class Mp4Video:
    width: int
    height: int
    sar: Fraction
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


def _collect(f: BinaryIO, start: int, end: int, out: dict, depth: int = 0) -> None:
    for kind, s, e in _boxes(f, start, end):
        if kind in CONTAINERS:
            if depth == MAX_DEPTH:
                raise Unreadable(f"boxes nested more than {MAX_DEPTH} deep")
            _collect(f, s, e, out, depth + 1)
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
            entry_end = s + 8 + struct.unpack(">I", entry[:4])[0]
            if entry_end > e:
                raise Unreadable(f"a sample entry of {entry_end - s - 8} bytes in an stsd box of {e - s}")
            out["entry_boxes"] = (s + 8 + 86, entry_end)
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


def _sar(f: BinaryIO, span) -> Fraction:
    body = _entry_box(f, span, b"pasp")
    if body and len(body) >= 8:
        h, v = struct.unpack(">II", body[:8])
        return Fraction(h, v) if h and v else Fraction(1)
    return Fraction(1)


def read(path: str) -> Mp4Video | None:
    """The first video track's header facts, or None when ffprobe should be asked instead."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            file_size = f.tell()
            moov = _find_moov(f, file_size)
            track = moov and _video_track(f, *moov)
            need = ("matrix", "timescale", "duration", "fourcc", "size", "frames")
            if not track or any(k not in track for k in need) or track["fourcc"] not in CODECS:
                return None
            if not track["frames"] or not track["timescale"] or not all(track["size"]):
                return None
            if track["frames"] > file_size:  # each sample is at least a byte of the file
                raise Unreadable(f"{track['frames']} samples listed in a file of {file_size} bytes")
            frames = _displayed_frames(f, track, _movie_timescale(f, *moov))
            if frames is None:
                return None
            if not frames:
                raise Unreadable("its edit shows none of the samples")
            a, b = track["matrix"][0], track["matrix"][1]
            rotation = round(-math.degrees(math.atan2(b, a))) % 360
            seconds = track["duration"] / track["timescale"]
            return Mp4Video(width=track["size"][0], height=track["size"][1],
                            sar=_sar(f, track["entry_boxes"]), rotation=rotation, num_frames=frames,
                            fps=track["frames"] / seconds if seconds else 0.0, duration=seconds,
                            codec=CODECS[track["fourcc"]], edited=frames != track["frames"])
    except (OSError, struct.error, IndexError, ValueError) as e:  # Unreadable among them
        log.debug("%s: %s: left to ffprobe", path, e or type(e).__name__)
        return None


def _table(f: BinaryIO, span, fmt: str, header: int = 8) -> Iterator[tuple]:
    """Entries of a full-box table: a 4-byte version/flags, an entry count, then the entries."""
    f.seek(span[0])
    body = f.read(span[1] - span[0])
    count = struct.unpack(">I", body[header - 4:header])[0]
    size = struct.calcsize(fmt)
    if header + count * size > len(body):
        raise Unreadable(f"a table of {count} entries of {size} bytes in a box of {len(body) + 8} bytes")
    return struct.iter_unpack(fmt, memoryview(body)[header:header + count * size])


def _runs(f: BinaryIO, tables: dict) -> Iterator[tuple[int, int, int]]:
    """The samples' presentation times as runs ``(n, first, step)``: the times first, first + step,
    ... of n samples in a row, from the ``stts`` runs (decode time steps) cut where the ``ctts``
    runs (composition offsets, signed whatever the box version says, as FFmpeg reads them) change."""
    steps = ((n, delta) for n, delta in _table(f, tables[b"stts"], ">II") if n)
    shifts = ((n, shift) for n, shift in _table(f, tables[b"ctts"], ">Ii") if n) if b"ctts" in tables \
        else iter([(math.inf, 0)])
    dts, (n_step, delta), (n_shift, shift) = 0, next(steps, (0, 0)), next(shifts, (0, 0))
    while n_step and n_shift:
        n = min(n_step, n_shift)
        yield n, dts + shift, delta
        dts += n * delta
        n_step, n_shift = n_step - n, n_shift - n
        if not n_step:
            n_step, delta = next(steps, (0, 0))
        if not n_shift:
            n_shift, shift = next(shifts, (0, 0))


def _inside(n: int, first: int, step: int, start: int, end: Fraction | float) -> int:
    """How many of the times first, first + step, ..., first + (n - 1) * step lie in [start, end)."""
    if step == 0:
        return n if start <= first < end else 0
    low = max(0, -((first - start) // step))  # the first k with first + k * step >= start
    high = n if end == math.inf else max(0, min(n, math.ceil((end - first) / step)))
    return max(0, high - low)


def _counts(f: BinaryIO, tables: dict) -> tuple[int, int | None]:
    """Samples the ``stts`` and the ``ctts`` (None: no ctts) list, from their run lengths."""
    steps = sum(n for n, _ in _table(f, tables[b"stts"], ">II"))
    shifts = sum(n for n, _ in _table(f, tables[b"ctts"], ">Ii")) if b"ctts" in tables else None
    return steps, shifts


def _displayed_frames(f: BinaryIO, track: dict, movie_timescale: int) -> int | None:
    """Samples whose presentation time lies inside the track's edit (all of them without an edit
    list); None for edit lists this reader does not model (several edits, rates other than 1)."""
    tables = track.get("tables", {})
    if b"elst" not in tables:
        return track["frames"]
    f.seek(tables[b"elst"][0])
    version = f.read(1)[0]
    fmt = ">Iihh" if version == 0 else ">Qqhh"
    edits = itertools.islice((e for e in _table(f, tables[b"elst"], fmt) if e[1] != -1), 2)  # -1: a delay
    edits = list(edits)
    if len(edits) != 1 or edits[0][2] != 1 or not movie_timescale or b"stts" not in tables:
        return None
    steps, shifts = _counts(f, tables)
    if steps != track["frames"] or shifts not in (None, steps):
        return None
    duration, start = edits[0][0], edits[0][1]
    # the float end, compared exactly (as an int compares with a float)
    end = Fraction(start + duration * track["timescale"] / movie_timescale) if duration else math.inf
    return sum(_inside(n, first, step, start, end) for n, first, step in _runs(f, tables))
