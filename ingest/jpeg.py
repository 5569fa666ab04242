"""JPEG encoding of decoded frames (PIL images, RGB or RGBX) with pillow-simd (Pillow's SIMD
fork), Pillow as fallback.

Frames are 4:2:0 (MCUs of 16 x 16 pixels) with restart markers every ``restart_interval``
MCUs, rounded down to a divisor of the MCUs in a row so that the intervals tile every MCU
row: each interval then starts with reset DC predictions at a known column, and the crop
decoder (``csrc/cropjpeg.c``) decodes only the intervals under the training crop, never
reading the entropy data above or beside it. ``restart_interval=0`` writes no markers.
"""
from __future__ import annotations

import io
import logging

import PIL
from PIL import Image

log = logging.getLogger("ingest.jpeg")
_warned = False
MCU = 16  # pixels: 4:2:0, Pillow's default subsampling, made explicit below


def is_pillow_simd() -> bool:
    return ".post" in PIL.__version__  # pillow-simd versions are X.Y.Z.postN


def restart_mcus(width: int, interval: int) -> int:
    """MCUs per restart interval for frames ``width`` pixels wide: the largest divisor of the
    MCUs per row that is at most ``interval`` (0: no restart markers)."""
    if interval <= 0:
        return 0
    per_row = -(-width // MCU)
    return next(n for n in range(min(interval, per_row), 0, -1) if per_row % n == 0)


def encode(image: Image.Image, quality: int, restart_interval: int = 1) -> bytes:
    global _warned
    if not _warned and not is_pillow_simd():
        log.warning("pillow-simd is not installed (PIL %s): JPEG encoding falls back to Pillow, "
                    "which is slower", PIL.__version__)
        _warned = True
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality, subsampling="4:2:0",
               restart_marker_blocks=restart_mcus(image.size[0], restart_interval))
    return buf.getvalue()


def restart_interval(jpeg: bytes) -> int:
    """MCUs per restart interval from a JPEG's DRI marker (0: none), read from the headers only."""
    p = 2
    while p + 4 <= len(jpeg) and jpeg[p] == 0xFF:
        marker, length = jpeg[p + 1], int.from_bytes(jpeg[p + 2:p + 4], "big")
        if marker == 0xDD:
            return int.from_bytes(jpeg[p + 4:p + 6], "big")
        if marker == 0xDA:  # start of scan: the headers are over
            break
        p += 2 + length
    return 0
