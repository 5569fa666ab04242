"""TSM's clip transforms on JPEG frames, producing uint8 arrays (T, H, W, C).

Frames are decoded with PIL; when a stored frame is at least twice the size needed, the
JPEG decoder's DCT scaling (``Image.draft``) decodes it at 1/2, 1/4 or 1/8 size directly.
Every frame of a clip gets the same crop and flip. Crop-and-resize is one ``resize(box=...)``
call per frame. Arrays stay channels-last, as decoded: moving channels first on the CPU is a
strided copy that costs about as much as the resize, while the loader can hand out a
(B, T, C, H, W) view of channels-last memory for free (see ``trainer.loader``).
Normalisation is left to the trainer (on the GPU when there is one).

A transform first draws a clip's ``Geometry`` (crop boxes, output side, flip) from the frame
size alone, then ``render`` applies it. The frame size is in the JPEG header, so the loader can
also hand out undecoded JPEG bytes with their geometry for the GPU to decode and apply
(``trainer.device_decode``), with the same random draws as the CPU path.

Training (TSM's GroupMultiScaleCrop + GroupRandomHorizontalFlip): a crop whose sides are
each one of (1, .875, .75, .66) x the short side, at most one scale step apart, placed at one
of 13 fixed positions, resized to ``crop_size``; horizontal flip with p=0.5 unless disabled
(direction-sensitive classes). Evaluation: short side to ``scale_size``, centre crop
``crop_size``; or TSM's full-resolution 3-crop test: three ``scale_size`` squares along the
long side (start, end, centre), giving (3, T, H, W, C).
"""
from __future__ import annotations

import io
import os
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image

SCALES = (1.0, 0.875, 0.75, 0.66)

# Pillow hands each freed image's memory back to the OS by default, so every decoded frame
# pays for page faults on fresh memory; keeping a few freed blocks for reuse makes decoding
# and resizing about 1.3x faster (bench/loader). A user's PILLOW_BLOCKS_MAX still wins.
if "PILLOW_BLOCKS_MAX" not in os.environ:
    Image.core.set_blocks_max(32)


def decode(jpeg: bytes, short_side: int) -> Image.Image:
    """Decode an RGB frame, letting libjpeg shrink it while its short side stays >= short_side."""
    img = Image.open(io.BytesIO(jpeg))
    w, h = img.size
    if min(w, h) >= 2 * short_side:
        f = short_side / min(w, h)
        img.draft("RGB", (int(w * f + 0.999), int(h * f + 0.999)))
    return img if img.mode == "RGB" else img.convert("RGB")


def jpeg_size(jpeg: bytes) -> tuple[int, int]:
    """(width, height) from the JPEG header, without decoding."""
    return Image.open(io.BytesIO(jpeg)).size


def _stack(frames: list[Image.Image]) -> np.ndarray:
    """PIL frames -> contiguous uint8 (T, H, W, C)."""
    w, h = frames[0].size
    out = np.empty((len(frames), h, w, 3), dtype=np.uint8)
    for t, img in enumerate(frames):
        out[t] = np.asarray(img)
    return out


def multiscale_box(w: int, h: int, crop_size: int, rng: random.Random,
                   scales=SCALES, max_distort: int = 1) -> tuple[int, int, int, int]:
    """TSM's multi-scale crop box (left, top, right, bottom) for a w x h frame."""
    base = min(w, h)
    sizes = [int(base * s) for s in scales]
    sizes = [crop_size if abs(s - crop_size) < 3 else s for s in sizes]
    pairs = [(sw, sh) for i, sh in enumerate(sizes) for j, sw in enumerate(sizes) if abs(i - j) <= max_distort]
    cw, ch = rng.choice(pairs)
    ws, hs = (w - cw) // 4, (h - ch) // 4
    # 13 positions in quarter steps: corners, centre, edge centres, and the four inner quarters
    steps = [(0, 0), (4, 0), (0, 4), (4, 4), (2, 2), (0, 2), (4, 2), (2, 4), (2, 0),
             (1, 1), (3, 1), (1, 3), (3, 3)]
    i, j = rng.choice(steps)
    x, y = i * ws, j * hs
    return x, y, x + cw, y + ch


@dataclass(frozen=True)
class Geometry:
    """Where a clip's views come from: crop boxes (left, top, right, bottom) in the pixels of the
    frame it was drawn for, the square side each box is resized to, and whether to flip."""
    boxes: tuple[tuple[float, float, float, float], ...]
    side: int
    flip: bool = False


def render(frames: list[Image.Image], g: Geometry) -> list[np.ndarray]:
    """One (T, H, W, C) array per box of ``g``: the same crop, resize and flip for every frame."""
    views = []
    for box in g.boxes:
        if box[2] - box[0] == g.side == box[3] - box[1]:  # no scaling needed: a plain crop
            crops = [f.crop(tuple(round(v) for v in box)) for f in frames]
        else:
            crops = [f.resize((g.side, g.side), Image.BILINEAR, box=box) for f in frames]
        if g.flip:
            crops = [c.transpose(Image.FLIP_LEFT_RIGHT) for c in crops]
        views.append(_stack(crops))
    return views


class TrainTransform:
    """Multi-scale crop to ``crop_size`` and optional horizontal flip, one draw per clip."""

    views = 1

    def __init__(self, crop_size: int = 224, scale_size: int = 256, flip: bool = True, scales=SCALES):
        self.crop_size, self.scale_size, self.flip, self.scales = crop_size, scale_size, flip, scales

    def geometry(self, w: int, h: int, rng: random.Random) -> Geometry:
        box = multiscale_box(w, h, self.crop_size, rng, self.scales)
        return Geometry((box,), self.crop_size, self.flip and rng.random() < 0.5)

    def __call__(self, jpegs: list[bytes], rng: random.Random) -> np.ndarray:
        return self.apply([decode(b, self.scale_size) for b in jpegs], rng)

    def apply(self, frames: list[Image.Image], rng: random.Random) -> np.ndarray:
        return render(frames, self.geometry(*frames[0].size, rng))[0]


class EvalTransform:
    """Short side to ``scale_size``, then a centre ``crop_size`` crop (``crops=1``) or TSM's
    three full-resolution ``scale_size`` crops (``crops=3``)."""

    def __init__(self, crop_size: int = 224, scale_size: int = 256, crops: int = 1):
        if crops not in (1, 3):
            raise ValueError("eval crops must be 1 or 3")
        self.crop_size, self.scale_size, self.views = crop_size, scale_size, crops

    def geometry(self, w: int, h: int, rng: random.Random | None = None) -> Geometry:
        f = min(w, h) / self.scale_size  # source pixels per pixel of the scaled frame
        sw, sh = w / f, h / f  # scaled frame size
        if self.views == 1:
            side = self.crop_size
            offsets = [((sw - side) / 2, (sh - side) / 2)]
        else:
            side = self.scale_size
            xs, ys = int(sw - side) // 4, int(sh - side) // 4
            offsets = [(0, 0), (4 * xs, 0), (2 * xs, 2 * ys)]
        return Geometry(tuple((x * f, y * f, (x + side) * f, (y + side) * f) for x, y in offsets), side)

    def __call__(self, jpegs: list[bytes], rng: random.Random | None = None) -> np.ndarray:
        return self.apply([decode(b, self.scale_size) for b in jpegs])

    def apply(self, frames: list[Image.Image], rng: random.Random | None = None) -> np.ndarray:
        views = render(frames, self.geometry(*frames[0].size))
        return views[0] if self.views == 1 else np.stack(views)
