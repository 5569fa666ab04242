"""JPEG encoding of decoded frames (PIL images, RGB or RGBX) with pillow-simd (Pillow's SIMD
fork), Pillow as fallback."""
from __future__ import annotations

import io
import logging

import PIL
from PIL import Image

log = logging.getLogger("ingest.jpeg")
_warned = False


def is_pillow_simd() -> bool:
    return ".post" in PIL.__version__  # pillow-simd versions are X.Y.Z.postN


def encode(image: Image.Image, quality: int) -> bytes:
    global _warned
    if not _warned and not is_pillow_simd():
        log.warning("pillow-simd is not installed (PIL %s): JPEG encoding falls back to Pillow, "
                    "which is slower", PIL.__version__)
        _warned = True
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
