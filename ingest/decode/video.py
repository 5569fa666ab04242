"""What both decoders (in-process ``pyav_decoder``, command-line ``ffmpeg_cli``) report about a
video, their shared error, and the output frame size.

The display size comes from the file's header (coded size, sample aspect ratio, rotation), which
damage can make anything: a display shape longer than ``MAX_ASPECT`` times its width either way
(a pasp box's spacing flipped to 2^31-1 makes a frame 2^31 times wider than coded, or 0 pixels
wide) is refused, before anything is scaled to it."""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from PIL import Image

MAX_ASPECT = 16  # display width to height, or height to width: no video is shaped beyond this


class DecodeError(Exception):
    """A video that cannot be used; ``reason`` is short, ``detail`` is the decoder's own message."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


@dataclass
class VideoInfo:
    width: int  # display size: after rotation and sample aspect ratio
    height: int
    coded_width: int
    coded_height: int
    rotation: int  # counter-clockwise degrees of the display matrix, mod 360
    fps: float
    num_frames: int  # frames displayed
    frame_count_source: str  # "container", "packets", "edit list" or "decoded"
    codec: str
    duration: float


@dataclass
class Decoded:
    info: VideoInfo
    frames: dict[int, Image.Image]  # display index -> frame at the output size, upright
    decoder: str  # its name in ingest.decode.DECODERS
    packets_decoded: int | None = None  # of all the stream's packets; None: not counted
    detail: str = field(default="")  # the decoder's warnings, if any
    # display index -> (field, valid): ingest.decode.motion
    motion: dict[int, tuple] = field(default_factory=dict)


def display_size(w: int, h: int, sar: Fraction, rotation: int) -> tuple[int, int]:
    display_w = w * sar if sar > 0 else Fraction(w)
    if not Fraction(h, MAX_ASPECT) <= display_w <= h * MAX_ASPECT:
        raise DecodeError(f"implausible display size: {round(display_w)}x{h} from {w}x{h} coded at sample "
                          f"aspect ratio {sar} (a damaged header?)")
    dw, dh = (h, display_w) if rotation in (90, 270) else (display_w, h)
    return int(round(dw)), int(round(dh))


def output_size(info: VideoInfo, short_side: int) -> tuple[int, int]:
    """Scale so the short side is ``short_side``, keeping the display aspect ratio; a video whose
    short side is smaller already is kept at its own size, never upscaled (as ``Image.thumbnail``
    and ImageMagick's ``256x256>`` do): upscaling adds bytes and no detail, and hides from the
    loader that its crops will be upsampled."""
    w, h = info.width, info.height
    if min(w, h) <= short_side:
        return w, h
    if w <= h:
        return short_side, max(1, round(h * short_side / w))
    return max(1, round(w * short_side / h)), short_side
