"""Motion fields as pictures: the colour coding of optical-flow figures, for the viewer and
``shards preview``.

The Middlebury convention (Baker et al., "A Database and Evaluation Methodology for Optical
Flow", IJCV 2011), which most optical-flow papers and tools draw with:

* direction is hue, on a colour wheel of 55 steps made of six ramps (red -> yellow 15 steps,
  yellow -> green 6, green -> cyan 4, cyan -> blue 11, blue -> magenta 13, magenta -> red 6):
  motion to the right is red, down yellow-orange, left cyan, up blue-violet;
* length is saturation: no motion is white, motion of ``scale`` pixels the wheel's full colour
  (longer is darkened to three quarters, as the convention marks out-of-range flow);
* a cell whose motion is not known (``shards.format.motionfield``'s validity plane: intra-coded frames
  and blocks) is black.

``render`` is what both callers use: a clip's stored fields (PNG bytes), one scale for the whole
clip (the 99th percentile of its known motion's lengths: frames compare with each other, and one
stray vector does not wash the rest out), each field enlarged cell by cell to its frame's size.
``legend`` is the wheel to show beside them.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from . import motionfield

# steps of red-yellow, yellow-green, green-cyan, cyan-blue, blue-magenta, magenta-red
RAMPS = (15, 6, 4, 11, 13, 6)
# a clip with no known motion longer than one quantisation step is drawn at this scale
MIN_SCALE = motionfield.STEP
SCALE_PERCENTILE = 99  # of a clip's known motion lengths: drawn at full colour


def _wheel() -> np.ndarray:
    """(55, 3) float RGB in [0, 1]: the hue of each step, red first, going red -> yellow -> ... -> magenta."""
    ry, yg, gc, cb, bm, mr = RAMPS
    up = lambda n: np.floor(255 * np.arange(n) / n)  # noqa: E731  0 .. 255 in n steps
    ramps = [
        np.stack([np.full(ry, 255), up(ry), np.zeros(ry)], 1),
        np.stack([255 - up(yg), np.full(yg, 255), np.zeros(yg)], 1),
        np.stack([np.zeros(gc), np.full(gc, 255), up(gc)], 1),
        np.stack([np.zeros(cb), 255 - up(cb), np.full(cb, 255)], 1),
        np.stack([up(bm), np.zeros(bm), np.full(bm, 255)], 1),
        np.stack([np.full(mr, 255), np.zeros(mr), 255 - up(mr)], 1),
    ]
    return np.concatenate(ramps) / 255


WHEEL = _wheel()


def colour(field: np.ndarray, valid: np.ndarray, scale: float) -> np.ndarray:
    """(rows, columns, 3) uint8 RGB of ``field`` (rows, columns, 2: u right, v down, pixels per
    frame) and ``valid`` (rows, columns), motion of ``scale`` pixels at full colour."""
    u, v = field[..., 0] / scale, field[..., 1] / scale
    length = np.hypot(u, v)
    steps = len(WHEEL)
    position = (np.arctan2(-v, -u) / np.pi + 1) / 2 * (steps - 1)  # the wheel's step, fractional
    k0 = np.floor(position).astype(int)
    k1 = (k0 + 1) % steps
    f = (position - k0)[..., None]
    hue = (1 - f) * WHEEL[k0] + f * WHEEL[k1]
    within = (length <= 1 + 1e-6)[..., None]  # motion of exactly ``scale`` is in range
    rgb = np.where(within, 1 - length[..., None] * (1 - hue), hue * 0.75)
    rgb[~valid] = 0
    return np.floor(255 * np.clip(rgb, 0, 1)).astype(np.uint8)


def clip_scale(fields: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Pixels per frame drawn at full colour: the ``SCALE_PERCENTILE`` of the clip's known
    motion's lengths (at least ``MIN_SCALE``)."""
    lengths = np.concatenate([np.hypot(f[..., 0], f[..., 1])[ok] for f, ok in fields] or [np.zeros(0)])
    return max(MIN_SCALE, float(np.percentile(lengths, SCALE_PERCENTILE))) if lengths.size else MIN_SCALE


def render(pngs: list[bytes], frame_size: tuple[int, int] | None = None) -> tuple[list[Image.Image], float]:
    """The coloured pictures of a clip's stored fields (``shards.format.motionfield`` PNGs, in frame
    order), each ``frame_size`` (width, height; default: ``GRID`` pixels a cell), and the scale
    they are drawn at (pixels per frame at full colour)."""
    fields = [motionfield.decode(data) for data in pngs]
    scale = clip_scale(fields)
    pictures = []
    for field, valid in fields:
        cells = colour(field, valid, scale).repeat(motionfield.GRID, 0).repeat(motionfield.GRID, 1)
        if frame_size is not None:
            cells = cells[:frame_size[1], :frame_size[0]]
        pictures.append(Image.fromarray(np.ascontiguousarray(cells), "RGB"))
    return pictures, scale


def png(picture: Image.Image) -> bytes:
    buf = io.BytesIO()
    picture.save(buf, "PNG", optimize=True)
    return buf.getvalue()


def legend(size: int = 96) -> Image.Image:
    """The colour wheel on white: the colour of every direction and length, full colour at the rim."""
    half = (size - 1) / 2
    y, x = np.mgrid[0:size, 0:size].astype(np.float64)
    u, v = (x - half) / half, (y - half) / half  # right and down, 1 at the rim
    rgb = colour(np.dstack([u, v]), np.ones((size, size), bool), 1.0)
    rgb[np.hypot(u, v) > 1] = 255
    return Image.fromarray(rgb, "RGB")
