"""What a coded frame means to the frames decoded after it, read from its packet's first bytes.

For each packet, without decoding: is it a **reference** (some later packet may need it decoded
first), and is it a **barrier** (no later packet, in decode order, needs anything before it: the
decoder can start afresh there)? A packet that is neither picked nor a reference can be left
out without changing a single pixel of any other frame; a run of packets that ends before a
barrier and holds no pick can be left out whole.

* H.264 (length-prefixed as in MP4/MKV, or Annex B): the first slice's ``nal_ref_idc`` (0: no
  other picture refers to it, what ``-skip_frame noref`` relies on); IDR slices are barriers.
* HEVC: sub-layer non-reference slice types (``TRAIL_N``, ``TSA_N``, ``STSA_N``, ``RADL_N``,
  ``RASL_N``, reserved ``RSV_VCL_N1x``) at the highest temporal layer of the stream are not
  references (``layer`` carries the temporal id for that); IDR slices are barriers.
* MPEG-4 part 2: B-VOPs are never references.
* VP9: every frame is a reference (a frame reuses the motion vectors of the frame decoded just
  before it, and may update the saved probability contexts, whatever its refresh flags say);
  key frames are barriers.
* anything else: every packet is a reference, none a barrier (decode everything up to the last
  pick).
"""
from __future__ import annotations

from dataclasses import dataclass

HEVC_SUBLAYER_NON_REFERENCE = {0, 2, 4, 6, 8, 10, 12, 14}
HEVC_IDR = {19, 20}
HEVC_VCL_MAX = 31


@dataclass(frozen=True)
class Coded:
    reference: bool
    barrier: bool = False
    layer: int = 0  # HEVC temporal id: a sub-layer non-reference picture below the top layer is a reference


ALWAYS = Coded(reference=True)


def _nal_headers(data, length_size: int | None):
    """The first two bytes of each NAL unit of one packet: length-prefixed (``length_size`` bytes,
    read in place) or Annex B (None: start codes)."""
    if length_size:
        view, pos = memoryview(data), 0
        while pos + length_size < len(view):
            n = int.from_bytes(view[pos:pos + length_size], "big")
            yield bytes(view[pos + length_size:pos + length_size + min(n, 2)])
            pos += length_size + n
        return
    data = bytes(data)
    start = data.find(b"\0\0\1")
    while start >= 0:
        yield data[start + 3:start + 5]
        start = data.find(b"\0\0\1", start + 3)


def h264(data, length_size: int | None) -> Coded:
    for nal in _nal_headers(data, length_size):
        if nal and nal[0] & 0x1F in (1, 5):  # coded slice: non-IDR, IDR
            return Coded(reference=nal[0] >> 5 & 3 != 0, barrier=nal[0] & 0x1F == 5)
    return ALWAYS


def hevc(data, length_size: int | None) -> Coded:
    for nal in _nal_headers(data, length_size):
        if len(nal) >= 2 and (nal[0] >> 1 & 0x3F) <= HEVC_VCL_MAX:
            kind, layer = nal[0] >> 1 & 0x3F, (nal[1] & 7) - 1
            return Coded(reference=kind not in HEVC_SUBLAYER_NON_REFERENCE, barrier=kind in HEVC_IDR,
                         layer=layer)
    return ALWAYS


def mpeg4(data, length_size: int | None = None) -> Coded:
    data, pos, kinds = bytes(data), 0, []
    while 0 <= (pos := data.find(b"\0\0\1\xb6", pos)) < len(data) - 4:
        kinds.append(data[pos + 4] >> 6)  # vop_coding_type: 0 I, 1 P, 2 B, 3 S
        pos += 4
    return Coded(reference=not kinds or any(k != 2 for k in kinds))


def vp9(data, length_size: int | None = None) -> Coded:
    data = bytes(memoryview(data)[:2])
    if len(data) < 1 or data[0] >> 6 != 2:  # frame_marker
        return ALWAYS
    profile = (data[0] >> 5 & 1) | (data[0] >> 3 & 2)
    bits = int.from_bytes(data.ljust(2, b"\0"), "big")
    at = 10 if profile == 3 else 11  # bit of show_existing_frame, after marker, profile (and a reserved bit)
    show_existing = bits >> at & 1
    key_frame = not show_existing and (bits >> (at - 1) & 1) == 0
    return Coded(reference=True, barrier=key_frame)


PARSERS = {"h264": h264, "hevc": hevc, "mpeg4": mpeg4, "vp9": vp9}


def length_size(codec: str, extradata: bytes | None) -> int | None:
    """NAL length-prefix size from an MP4/MKV decoder configuration record (avcC, hvcC); None
    for Annex B streams (MPEG-TS, raw), which carry start codes instead."""
    if not extradata or extradata[0] != 1:
        return None
    if codec == "h264" and len(extradata) >= 5:
        return (extradata[4] & 3) + 1
    if codec == "hevc" and len(extradata) >= 22:
        return (extradata[21] & 3) + 1
    return None


def parser(codec: str, extradata: bytes | None):
    """A function packet bytes -> ``Coded`` for this stream."""
    parse = PARSERS.get(codec)
    if parse is None:
        return lambda data: ALWAYS
    size = length_size(codec, extradata)
    return lambda data: parse(data, size)
