"""Reading an MP4/MOV video track's header in-process, without starting ffprobe.

Starting the ffprobe binary costs about as much as decoding a short low-resolution clip, and
Kinetics is almost all MP4, so for MP4/MOV files the few facts sampling needs (frame count, size,
sample aspect ratio, rotation, frame rate, codec) are read from the ``moov`` box directly. Any
file this reader does not fully understand returns ``None`` and goes to ffprobe instead.

``reference_frames`` also reads the sample tables and the first bytes of every H.264 sample, to
tell which frames other frames depend on (``ingest build --decode refs``).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import BinaryIO

CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl"}
TABLES = {b"stts", b"ctts", b"stsz", b"stco", b"co64", b"stsc"}  # read whole, on demand
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
        elif kind == b"elst":
            out["edits"] = struct.unpack(">I", body[4:8])[0]


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


def _table(f: BinaryIO, span, fmt: str, header: int = 8) -> list[tuple]:
    """Entries of a full-box table: a 4-byte version/flags, an entry count, then the entries."""
    f.seek(span[0])
    body = f.read(span[1] - span[0])
    count = struct.unpack(">I", body[header - 4:header])[0]
    size = struct.calcsize(fmt)
    return [struct.unpack_from(fmt, body, header + i * size) for i in range(count)]


def _sample_offsets(f: BinaryIO, tables: dict, sizes: list[int]) -> list[int]:
    """File offset of every sample (decode order), from chunk offsets and the sample-to-chunk map."""
    chunks = ([o for o, in _table(f, tables[b"co64"], ">Q")] if b"co64" in tables
              else [o for o, in _table(f, tables[b"stco"], ">I")])
    runs = _table(f, tables[b"stsc"], ">III")  # (first chunk, samples per chunk, description)
    offsets, sample = [], 0
    for i, (first, per_chunk, _) in enumerate(runs):
        last = runs[i + 1][0] - 1 if i + 1 < len(runs) else len(chunks)
        for chunk in range(first - 1, last):
            pos = chunks[chunk]
            for _ in range(per_chunk):
                if sample == len(sizes):
                    return offsets
                offsets.append(pos)
                pos += sizes[sample]
                sample += 1
    return offsets


def _is_reference(f: BinaryIO, offset: int, size: int, length_size: int) -> bool:
    """Whether an H.264 sample (length-prefixed NAL units) is a reference picture: the
    ``nal_ref_idc`` of its first slice NAL unit is non-zero."""
    pos, end = offset, offset + size
    while pos + length_size < end:
        f.seek(pos)
        head = f.read(length_size + 1)
        n = int.from_bytes(head[:length_size], "big")
        nal_type, ref_idc = head[length_size] & 0x1F, head[length_size] >> 5 & 3
        if nal_type in (1, 5):  # coded slice (non-IDR, IDR)
            return ref_idc != 0
        pos += length_size + n
    raise ValueError("sample without a slice")


def reference_frames(path: str) -> list[bool] | None:
    """For an H.264 MP4, whether each frame, in display order, is a reference picture (decoders
    can skip the others without harm: ffmpeg's ``-skip_frame noref``). None when the file is not
    one this reader fully understands."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            moov = _find_moov(f, f.tell())
            track = moov and _video_track(f, *moov)
            if not track or track.get("fourcc") not in (b"avc1", b"avc3") or track.get("edits", 1) > 1:
                return None
            tables = track.get("tables", {})
            if not {b"stts", b"stsz", b"stsc"} <= tables.keys() or not {b"stco", b"co64"} & tables.keys():
                return None
            avcc = _entry_box(f, track["entry_boxes"], b"avcC")
            if not avcc or len(avcc) < 5:
                return None
            length_size = (avcc[4] & 3) + 1
            f.seek(tables[b"stsz"][0])
            fixed, count = struct.unpack(">4xII", f.read(12))
            sizes = [fixed] * count if fixed else [s for s, in _table(f, tables[b"stsz"], ">I", header=12)]
            offsets = _sample_offsets(f, tables, sizes)
            dts = [0]
            for n, delta in _table(f, tables[b"stts"], ">II"):
                dts += [dts[-1] + delta * (k + 1) for k in range(n)]
            shifts = [0] * count
            if b"ctts" in tables:
                shifts = [shift for n, shift in _table(f, tables[b"ctts"], ">Ii") for _ in range(n)]
            if len(offsets) != count or len(dts) < count or len(shifts) != count:
                return None
            refs = [_is_reference(f, offsets[i], sizes[i], length_size) for i in range(count)]
            display = sorted(range(count), key=lambda i: (dts[i] + shifts[i], i))
            return [refs[i] for i in display]
    except (OSError, struct.error, IndexError, ValueError):
        return None
