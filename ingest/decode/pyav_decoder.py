"""In-process decoding with PyAV (the FFmpeg libraries' own binding): no process per video, and
only the packets the kept frames need.

1. Open the file through a Python file object (so the video's deadline can interrupt a read
   blocked on a pipe) and index its video packets once: pts, the container's discard flag (edit
   lists), and what ``bitstream`` reads from each packet's first bytes.
2. The frames are the displayed packets in pts order (``packets.displayed``): their count is
   what the file shows, and the clip sampling picks among them.
3. Feed the decoder only what ``packets.plan`` says the picks need, in decode order, stop after
   the last pick, and keep the output frames whose pts is a pick's: bit-identical to a full
   decode's (``tests/test_pyav_decoder.py`` checks every codec and container of the test media).
4. When timestamps cannot map display order, or a pick does not come out, decode everything:
   once to count the displayed frames, once to keep the picks. The first pass stamps each packet
   with its decode index as its pts, which the decoder hands on to the frame it makes: the
   frames' display order is then known in decode indices, as step 2 knows it from timestamps.

``decode_frames`` returns the kept frames as the decoder gives them; ``decode`` scales and turns
them for the JPEG encoder. With ``motion_vectors`` the decoder also exports the codec's motion
vectors of the kept frames, which ``decode`` makes into fields (``ingest.decode.motion``): no other
frame is decoded for them. Their reference distances come from the packet index and the display
order (step 2, or the stamps of step 4: an elementary stream such as ``.h264`` has no
timestamps); where a packet makes more than one frame (MPEG-4 Part 2's packed B-frames), or none
is stamped, they are unknown: the fields are left invalid, with a warning.

MPEG-4 Part 2 (Xvid, DivX: UCF101's and HMDB51's AVIs) codes most B-frame blocks in direct mode,
whose motion is the co-located block's of the next reference frame scaled by the frames between
them, and FFmpeg exports zeros for every block of such a B-frame. A B-frame of that codec takes
the velocity field of its future reference instead (the same constant-motion assumption direct
mode makes), or of its past one when the future one is intra, from frames it needs decoded anyway
(``ingest.decode.motion.stand_ins``); with neither, its field is invalid. The decoder holds the last
reference frame back until the next one arrives, and drained it carries no vectors: for this
codec one more reference packet is fed after the last pick (one packet per video).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import av
import av.logging
from PIL import Image

from shards.base.pillow_memory import keep_freed_blocks

from . import bitstream, motion, packets
from .deadline import Deadline
from .video import Decoded, DecodeError, VideoInfo, display_size, output_size

log = logging.getLogger("ingest.pyav")
TRANSPOSE = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}
EXACT_COUNT_CONTAINERS = ("mov", "mp4")  # their sample tables list every packet: fewer means truncated
keep_freed_blocks(16)


@dataclass
class Frames:
    """What ``decode_frames`` found: the kept frames as the decoder gave them, and how."""
    frames: dict[int, av.VideoFrame]  # display index -> frame
    num_frames: int  # displayed frames of the video
    counted_by: str  # "packets" (the index) or "decoded" (a full decode)
    packets_decoded: int | None  # None: all of them (full decode)
    packets: int | None
    errors: list[str]
    stream: dict  # codec, sample aspect ratio, frame rate, duration
    # pick -> reference distances (ingest.decode.motion)
    distances: dict[int, tuple] = field(default_factory=dict)
    # pick -> the frame whose vectors it takes (None: no motion known; the rest: its own)
    vectors_of: dict[int, av.VideoFrame | None] = field(default_factory=dict)


def _stream_facts(stream) -> dict:
    return {"codec": stream.codec_context.name, "sar": Fraction(stream.sample_aspect_ratio or 0),
            "fps": float(stream.average_rate or stream.guessed_rate or 0),
            "duration": (float(stream.duration * stream.time_base) if stream.duration and stream.time_base
                         else 0.0)}


def _open(f):
    try:
        # tags are not used here, and a damaged one is not valid UTF-8 (PyAV's strict default raises)
        container = av.open(f, "r", metadata_errors="replace")
    except av.error.FFmpegError as e:
        raise DecodeError("not a readable video", str(e)) from None
    videos = [s for s in container.streams if s.type == "video"
              and not s.disposition & av.stream.Disposition.attached_pic]
    if not videos:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        container.close()
        raise DecodeError(f"no video stream (streams: {', '.join(kinds)})")
    if videos[0].codec_context is None:  # a header too damaged to name the codec (cut before its stsd)
        container.close()
        raise DecodeError("not a readable video", "the video stream's codec is unknown")
    return container, videos[0]


def _index(container, stream, deadline: Deadline) -> tuple[list, list[packets.Packet]]:
    """Every packet of the stream, in decode order, and its index entry."""
    deadline.check("reading packets")
    parse = bitstream.parser(stream.codec_context.name, stream.codec_context.extradata)
    demuxed, coded = [], []
    try:
        for p in container.demux(stream):
            if p.size:
                demuxed.append(p)
                coded.append(parse(p))
    except av.error.FFmpegError as e:
        raise DecodeError("truncated or corrupt: the container cannot be read to its end", str(e)) from None
    deadline.check("decoding")
    top = max((c.layer for c in coded), default=0)
    index = [packets.Packet(p.pts, p.is_discard, c.reference or c.layer < top, c.barrier)
             for p, c in zip(demuxed, coded)]
    declared = stream.frames
    if declared and len(demuxed) < declared and container.format.name.startswith(EXACT_COUNT_CONTAINERS):
        raise DecodeError(f"truncated or corrupt: {len(demuxed)} of the {declared} frames the "
                          "container lists")
    return demuxed, index


def _decoder(stream, threads: int, motion_vectors: bool = False):
    cc = stream.codec_context
    cc.thread_count = threads
    cc.thread_type = "AUTO" if threads > 1 else "NONE"
    if motion_vectors:
        cc.options = {"flags2": "+export_mvs"}
    return cc


def _frames(cc, packet, errors: list[str]):
    """Frames the decoder gives for ``packet`` (None: drain); a packet it rejects is noted, as
    the ffmpeg CLI notes and skips it."""
    try:
        return cc.decode(packet)
    except av.error.FFmpegError as e:
        errors.append(str(e))
        return []


def decode_frames(path: str, wanted: Callable[[int], list[int]], *, threads: int = 1,
                  deadline: Deadline, motion_vectors: bool = False) -> Frames:
    """The frames ``wanted(frame count)`` (display indices) of ``path``, decoded from the packets
    they need, or from all of them when the index cannot tell."""
    if av.logging.get_level() is None:
        av.logging.set_level(av.logging.ERROR)  # so errors carry FFmpeg's own last message
        # ... which the ledger records; printed as well, Ray would forward it to the driver's log.
        logging.getLogger("libav").propagate = False
        logging.getLogger("libav").addHandler(logging.NullHandler())
    deadline.check("probing")
    with open(path, "rb") as f:
        container, stream = _open(f)
        with container:
            demuxed, index = _index(container, stream, deadline)
            order = packets.displayed(index)
            if order is not None:
                if not order:
                    raise DecodeError("video stream has no frames")
                found = _selective(demuxed, index, order, stream, wanted, threads, deadline, motion_vectors)
                if found is not None:
                    return found
    return _two_passes(path, wanted, threads, deadline, motion_vectors, index)


def _selective(demuxed, index, order, stream, wanted, threads, deadline, motion_vectors) -> Frames | None:
    """Decode only the packets the picks need; None if a pick does not come out."""
    picks = sorted(set(wanted(len(order))))
    distances = motion.reference_distances(index, order, picks) if motion_vectors else {}
    part2 = motion_vectors and stream.codec_context.name == "mpeg4"
    stand_ins = motion.stand_ins(index, order, distances) if part2 else {}
    references = {r for candidates in stand_ins.values() for r in candidates}
    distances |= motion.reference_distances(index, order, sorted(references))
    keep = {demuxed[order[i]].pts: i for i in {*picks, *references}}
    feed = packets.plan(index, {order[i] for i in picks})
    if part2:  # the decoder may hold the last reference frame back, and drained it has no vectors
        feed += [k for k in range(feed[-1] + 1, len(index)) if index[k].reference][:1]
    cc, frames, errors = _decoder(stream, threads, motion_vectors), {}, []
    for k in [*feed, None]:
        deadline.check("decoding")
        for frame in _frames(cc, None if k is None else demuxed[k], errors):
            i = keep.get(frame.pts)
            if i is not None and i not in frames:
                frames[i] = frame
    if any(i not in frames for i in picks):
        return None
    vectors_of = {i: next((r for r in stand_ins[i] if r in frames and _vectors(frames[r]) is not None), None)
                  for i in picks if i in stand_ins}
    distances |= {i: distances[r] for i, r in vectors_of.items() if r is not None}
    vectors_of = {i: None if r is None else frames[r] for i, r in vectors_of.items()}
    return Frames({i: frames[i] for i in picks}, len(order), "packets", len(feed), len(demuxed), errors,
                  _stream_facts(stream), distances, vectors_of)


def _every_frame(path, threads, deadline, step, errors, motion_vectors=False):
    """(stream, frame) for every frame a full decode of a fresh open of ``path`` displays; each
    frame's pts is the decode index of the packet that made it (step 4)."""
    with open(path, "rb") as f:
        container, stream = _open(f)
        with container:
            cc = _decoder(stream, threads, motion_vectors)
            k = 0
            for packet in container.demux(stream):
                deadline.check(step)
                if packet.size:
                    packet.pts = packet.dts = k
                    k += 1
                for frame in _frames(cc, packet if packet.size else None, errors):
                    yield stream, frame


def _decoded_distances(path, index: list[packets.Packet], order: list, picks: list[int]) -> dict[int, tuple]:
    """``motion.reference_distances`` from the display order a full decode showed (``order``: the
    decode index stamped on each displayed frame); {} with a warning where the stamps cannot say."""
    if None in order or len(set(order)) != len(order) or max(order) >= len(index):
        log.warning("%s: the decoder's display order does not map to its packets (a packet made several "
                    "frames, or none): the motion fields of --motion mv are left invalid", path)
        return {}
    return motion.reference_distances(index, order, picks)


def _two_passes(path, wanted, threads, deadline, motion_vectors, index) -> Frames:
    """Decode everything once to count the displayed frames (and learn their decode order), then
    again up to the last pick."""
    errors = []
    order = [frame.pts for _, frame in _every_frame(path, threads, deadline, "counting frames", errors)]
    counted = len(order)
    if not counted:
        raise DecodeError("no frame decodes", " | ".join(errors[-4:]))
    picks = sorted(set(wanted(counted)))
    distances = _decoded_distances(path, index, order, picks) if motion_vectors else {}
    frames, facts = {}, {}
    for shown, (stream, frame) in enumerate(_every_frame(path, threads, deadline, "decoding", errors,
                                                         motion_vectors)):
        if shown in picks:
            frames[shown], facts = frame, _stream_facts(stream)
        if shown >= picks[-1]:
            break
    if len(frames) < len(picks):
        raise DecodeError(f"truncated or corrupt: decoded {len(frames)} of {len(picks)} wanted frames",
                          " | ".join(errors[-4:]))
    return Frames(frames, counted, "decoded", None, None, errors, facts, distances)


def decode(path: str, wanted: Callable[[int], list[int]], short_side: int, *, threads: int = 1,
           deadline: Deadline, motion_vectors: bool = False) -> Decoded:
    """The frames ``wanted(frame count)`` (display indices) of ``path``, scaled and upright, and
    with ``motion_vectors`` their motion fields from the codec's vectors.

    A frame is converted and scaled by one swscale pass into packed RGB, which PIL copies into its
    own 4-byte pixels; a rotation is one transpose of the scaled image. Not into a 4-byte ``rgb0``
    buffer that PIL could use in place: PyAV allocates that one without padding past the width,
    and swscale's unscaled SIMD YUV-to-RGB conversion, which writes 8 pixels at a time, then leaves
    the last ``width % 8`` columns (up to 4) unwritten whenever the frame is not resized: there
    the stored frames held whatever the buffer held before (``tests/test_pyav_decoder.py``)."""
    found = decode_frames(path, wanted, threads=threads, deadline=deadline, motion_vectors=motion_vectors)
    first = next(iter(found.frames.values()))
    facts = found.stream
    rotation = round((first.rotation or 0) / 90) * 90 % 360  # counter-clockwise, as ffprobe reports it
    w, h = display_size(first.width, first.height, facts["sar"], rotation)
    info = VideoInfo(w, h, first.width, first.height, rotation, facts["fps"], found.num_frames,
                     found.counted_by, facts["codec"], facts["duration"])
    size = output_size(info, short_side)
    scaled = size if rotation not in (90, 270) else size[::-1]  # scaled before turning
    images, fields = {}, {}
    for i, frame in found.frames.items():
        if motion_vectors:
            vectors = _vectors(found.vectors_of[i]) if i in found.vectors_of else _vectors(frame)
            fields[i] = _mv_field(frame, vectors, found.distances.get(i, (None, None)), scaled, rotation)
        rgb = frame.reformat(width=scaled[0], height=scaled[1], format="rgb24", interpolation="AREA",
                             threads=threads)
        plane = rgb.planes[0]
        image = Image.frombuffer("RGB", scaled, plane, "raw", "RGB", plane.line_size, 1)
        images[i] = image.transpose(TRANSPOSE[rotation]) if rotation in TRANSPOSE else image
    return Decoded(info, images, "pyav", packets_decoded=found.packets_decoded,
                   detail=" | ".join(found.errors[-4:]), motion=fields)


def _vectors(frame):
    """A decoded frame's exported motion vectors (None: no inter block, or no frame)."""
    side = None if frame is None else frame.side_data.get("MOTION_VECTORS")
    return None if side is None else side.to_ndarray()


def _mv_field(frame, vectors, distances: tuple, scaled: tuple[int, int], rotation: int):
    """(field, valid) of one decoded frame from motion ``vectors`` (None: intra)."""
    velocity, inter = motion.coded_velocity(vectors, frame.width, frame.height, distances)
    return motion.to_output_grid(velocity, inter, (frame.width, frame.height), scaled, rotation)
