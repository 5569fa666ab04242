"""TSM's clip transforms on JPEG frames, producing uint8 arrays (T, H, W, C) written in place.

A transform first draws a clip's ``Geometry`` (crop boxes, output side, flip) from the frame
size in the JPEG header alone, then renders every frame into the array it is given (a slot of
the loader's shared-memory pool, ``trainer.data.slots``), with the same crop and flip for all
frames. The header is also all that ``decode_on_device`` needs: the loader can hand out
undecoded bytes with their geometry for the GPU (``trainer.data.device_decode``), with the same
random draws as here.

Decoding (libjpeg-turbo): only the rectangle the views need is decoded (``trainer.data.cropdecode``:
of a frame with restart markers, only the intervals under it; else rows above skipped, rows
below never decoded, columns outside not transformed); without that
library, whole frames with PIL. When a stored frame is at least twice the size needed, the
decoder's DCT scaling decodes it at 1/2, 1/4 or 1/8 size directly (the rule of PIL's
``draft``, ``dct_denom``), and boxes are drawn on the scaled frame. A box of exactly the output
size is decoded straight into the output; others are resized there with OpenCV (bilinear, area
averaging when shrinking), measured 3.5x faster than PIL's resize plus the copy out of PIL
(``bench/loader.py``); boxes with fractional corners (some evaluation views) use PIL's resize.
Arrays stay channels-last, as decoded: moving channels first on the CPU is a strided copy that
costs about as much as the resize, while the loader can hand out a (B, T, C, H, W) view of
channels-last memory for free (see ``trainer.data.loader``). Normalisation is left to the trainer
(on the GPU when there is one).

Training (TSM's GroupMultiScaleCrop + GroupRandomHorizontalFlip): a crop whose sides are
each one of (1, .875, .75, .66) x the short side, at most one scale step apart, placed at one
of 13 fixed positions, resized to ``crop_size``; horizontal flip with p=0.5 unless disabled
(direction-sensitive classes). Evaluation: short side to ``scale_size``, centre crop
``crop_size``; or TSM's full-resolution 3-crop test: three ``scale_size`` squares along the
long side (start, end, centre), giving (3, T, H, W, C).

``upsampling``: whether a transform's crops are larger than a set's stored frames (the loader warns
``Upsampling`` on rank 0).
"""
from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image

from shards.base.pillow_memory import keep_freed_blocks
from shards.format.manifest import Manifest
from shards.format.sample import jpeg_size

from . import cropdecode

try:  # the trainer's and ingest's installs have it; the reading-only install resizes with PIL
    import cv2
except ImportError:
    cv2 = None

SCALES = (1.0, 0.875, 0.75, 0.66)

keep_freed_blocks(32)
# One thread per loader worker (the workers are the parallelism); this also keeps OpenCV from
# starting a thread pool before the loader forks its workers.
if cv2 is not None:
    cv2.setNumThreads(1)


def decode(jpeg: bytes, short_side: int) -> Image.Image:
    """A whole RGB frame with PIL, scaled in the DCT domain by ``dct_denom``."""
    img = Image.open(io.BytesIO(jpeg))
    w, h = img.size
    d = dct_denom(w, h, short_side)
    if d > 1:
        img.draft("RGB", (w // d, h // d))  # PIL picks exactly 1/d for this request
    return img if img.mode == "RGB" else img.convert("RGB")


def dct_denom(w: int, h: int, short_side: int) -> int:
    """The DCT scaling 1/d (d in 1, 2, 4, 8) for a w x h frame whose short side must stay at
    least ``short_side``: scaling only from twice that size, then as far as PIL's ``draft``
    goes for the smallest such frame (it rounds the ratio down to a power of two)."""
    if min(w, h) < 2 * short_side:
        return 1
    f = short_side / min(w, h)
    ratio = min(w // int(w * f + 0.999), h // int(h * f + 0.999))
    return next(d for d in (8, 4, 2, 1) if ratio >= d)


def scaled(w: int, h: int, d: int) -> tuple[int, int]:
    """Frame size decoded at 1/d (libjpeg rounds up)."""
    return -(-w // d), -(-h // d)


def read_box(jpeg: bytes, box: tuple[int, int, int, int], d: int,
             out: np.ndarray | None = None, lib=None) -> np.ndarray:
    """RGB pixels of ``box`` (integer corners) of the frame decoded at 1/d, into ``out`` if given:
    only the box with ``cropdecode`` (``lib``: its library, once per clip; else looked up), else a
    whole-frame PIL decode, cropped."""
    lib = lib or cropdecode.load()
    if lib is not None:
        return cropdecode.decode_crop(jpeg, box, d, out, lib)
    img = Image.open(io.BytesIO(jpeg))
    if d > 1:
        img.draft("RGB", (img.size[0] // d, img.size[1] // d))
    pixels = np.asarray(img if img.mode == "RGB" else img.convert("RGB"))[box[1]:box[3], box[0]:box[2]]
    if out is None:
        return pixels
    out[...] = pixels
    return out


def _integral(box) -> bool:
    return all(float(v).is_integer() for v in box)


def resize_into(src: np.ndarray, box, out: np.ndarray, flip: bool) -> None:
    """``box`` (left, top, right, bottom) of ``src`` resized to ``out`` (side, side, 3), mirrored
    when ``flip``. Bilinear like TSM's PIL resize; shrinking averages areas instead of sampling."""
    side = out.shape[0]
    if _integral(box):
        x0, y0, x1, y1 = (int(v) for v in box)
        crop = src[y0:y1, x0:x1]
        if crop.shape[:2] == (side, side):
            np.copyto(out, crop[:, ::-1] if flip else crop)
            return
    if _integral(box) and cv2 is not None:
        # bilinear samples 2 x 2 pixels: enough up to a 2x shrink (TSM's crops shrink at most 1.6x);
        # beyond that, area averaging (5x slower) keeps fine texture from aliasing
        shrink = max(crop.shape[:2]) >= 2 * side
        cv2.resize(crop, (side, side), dst=out, interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
    else:  # fractional corners (evaluation views of rescaled frames), or no OpenCV: PIL resamples
        out[...] = np.asarray(Image.fromarray(src).resize((side, side), Image.BILINEAR, box=box))
    if flip:
        mirror(out)


def mirror(frame: np.ndarray) -> None:
    """``frame`` (H, W, C) flipped left to right in place."""
    if cv2 is not None:
        cv2.flip(frame, 1, dst=frame)
    else:
        frame[...] = frame[:, ::-1].copy()


def multiscale_box(w: int, h: int, crop_size: int, rng: random.Random,
                   scales=SCALES, max_distort: int = 1) -> tuple[int, int, int, int]:
    """TSM's multi-scale crop box (left, top, right, bottom) for a w x h frame."""
    base = min(w, h)
    sizes = [int(base * s) for s in scales]
    sizes = [crop_size if abs(s - crop_size) < 3 else s for s in sizes]
    pairs = [(sw, sh) for i, sh in enumerate(sizes) for j, sw in enumerate(sizes)
             if abs(i - j) <= max_distort]
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

    def region(self, w: int, h: int) -> tuple[int, int, int, int]:
        """The integer rectangle of a w x h frame that rendering reads: every box, plus a margin
        for the resampling filter around boxes with fractional corners."""
        pad = 0 if all(map(_integral, self.boxes)) else 2 + max(b[2] - b[0] for b in self.boxes) // self.side
        return (max(0, int(min(b[0] for b in self.boxes) - pad)),
                max(0, int(min(b[1] for b in self.boxes) - pad)),
                min(w, math.ceil(max(b[2] for b in self.boxes) + pad)),
                min(h, math.ceil(max(b[3] for b in self.boxes) + pad)))


class _Transform:
    """Shared by both transforms: draw a geometry from the header, render every frame into place.
    ``out`` is (T, side, side, 3) for one view, (views, T, side, side, 3) for several."""

    views = 1
    channels = 3

    def shape(self, frames: int) -> tuple[int, ...]:
        return ((self.views,) if self.views > 1 else ()) + (frames, self.side, self.side, self.channels)

    def members(self, sample: dict) -> list[bytes]:
        """A sample's JPEG frames in order (``trainer.data.stages``): what ``into`` renders."""
        return sample["frames"]

    def __call__(self, jpegs: list[bytes], rng: random.Random | None = None) -> np.ndarray:
        out = np.empty(self.shape(len(jpegs)), dtype=np.uint8)
        self.into(jpegs, rng, out)
        return out

    def draw(self, jpeg: bytes, rng: random.Random | None) -> tuple[Geometry, int, tuple[int, int]]:
        """A clip's geometry, drawn from its first frame's header alone: (the geometry, in pixels of
        the frame decoded at 1/d; the DCT denominator d; that decoded frame's size)."""
        w, h = jpeg_size(jpeg)
        d = dct_denom(w, h, self.scale_size)
        size = scaled(w, h, d)
        return self.geometry(*size, rng), d, size

    def into(self, jpegs: list[bytes], rng: random.Random | None, out: np.ndarray) -> Geometry:
        g, d, size = self.draw(jpegs[0], rng)
        views = out if self.views > 1 else out[None]
        x0, y0, x1, y1 = g.region(*size)
        direct = self.views == 1 and (x0, y0, x1, y1) == g.boxes[0] and (x1 - x0, y1 - y0) == (g.side, g.side)
        lib = cropdecode.load()
        for t, jpeg in enumerate(jpegs):
            if direct:  # the box is the output: decode straight into it
                read_box(jpeg, (x0, y0, x1, y1), d, views[0, t], lib)
                if g.flip:
                    mirror(views[0, t])
                continue
            src = read_box(jpeg, (x0, y0, x1, y1), d, self._scratch((y1 - y0, x1 - x0, 3)), lib)
            for box, view in zip(g.boxes, views):
                resize_into(src, (box[0] - x0, box[1] - y0, box[2] - x0, box[3] - y0), view[t], g.flip)
        return g

    def _scratch(self, shape) -> np.ndarray:
        """Reused memory for the decoded region (fresh memory would cost page faults per frame)."""
        n = math.prod(shape)
        if getattr(self, "_buffer", None) is None or self._buffer.size < n:
            self._buffer = np.empty(n, dtype=np.uint8)
        return self._buffer[:n].reshape(shape)

    def apply(self, frames: list[Image.Image], rng: random.Random | None = None) -> np.ndarray:
        """The transform on decoded PIL frames (for datasets that decode elsewhere)."""
        g = self.geometry(*frames[0].size, rng)
        out = np.empty(self.shape(len(frames)), dtype=np.uint8)
        views = out if self.views > 1 else out[None]
        for t, frame in enumerate(frames):
            src = np.asarray(frame.convert("RGB"))
            for box, view in zip(g.boxes, views):
                resize_into(src, box, view[t], g.flip)
        return out


class TrainTransform(_Transform):
    """Multi-scale crop to ``crop_size`` and optional horizontal flip, one draw per clip."""

    def __init__(self, crop_size: int = 224, scale_size: int = 256, flip: bool = True, scales=SCALES):
        self.crop_size, self.scale_size, self.flip, self.scales = crop_size, scale_size, flip, scales
        self.side = crop_size

    def geometry(self, w: int, h: int, rng: random.Random) -> Geometry:
        box = multiscale_box(w, h, self.crop_size, rng, self.scales)
        return Geometry((box,), self.crop_size, self.flip and rng.random() < 0.5)


class EvalTransform(_Transform):
    """Short side to ``scale_size``, then a centre ``crop_size`` crop (``crops=1``) or TSM's
    three full-resolution ``scale_size`` crops (``crops=3``)."""

    def __init__(self, crop_size: int = 224, scale_size: int = 256, crops: int = 1):
        if crops not in (1, 3):
            raise ValueError("eval crops must be 1 or 3")
        self.crop_size, self.scale_size, self.views = crop_size, scale_size, crops
        self.side = crop_size if crops == 1 else scale_size

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


class Upsampling(UserWarning):
    """Crops larger than the stored frames: the clips are upscaled (``upsampling``)."""


def upsampling(manifest: Manifest, transform) -> str | None:
    """Why ``transform``'s crops of this set's frames are upscaled, or None: a training crop
    larger than the frames' short side as stored, or an evaluation scale or crop larger than it."""
    short = manifest.config.get("clip", {}).get("short_side")  # as ingest writes it; other sets may lack it
    need = transform.crop_size if isinstance(transform, TrainTransform) else max(transform.crop_size,
                                                                                  transform.scale_size)
    if not short or need <= short:
        return None
    return (f"crop_size={transform.crop_size}, scale_size={transform.scale_size}: the frames of "
            f"{manifest.base or 'the shard set'} are {short} pixels on their short side, so the clips are "
            f"upscaled (scale_size={short}, crop_size={short * transform.crop_size // transform.scale_size} "
            "would crop them as stored)")
