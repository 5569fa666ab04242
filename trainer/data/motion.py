"""The motion stream's input: a clip's stored motion fields, rendered with the geometry its frames would get.

``ingest build --motion mv|flow`` stores a field beside every frame (``shards.format.motionfield``: one cell
per 8 x 8 pixels of the stored frame, u and v quantised as ``q = 128 + round(u * 127 / 20)``). With
``--modality motion`` the loader renders each clip's fields instead of decoding its JPEGs, and only
that step differs: the clip's ``Geometry`` is drawn exactly as for its frames (from the first JPEG's
header, with the same random draws; the JPEG itself is never decoded), so a clip's crop, flip and
multigrid part are the ones its RGB frames would get, and every loader guarantee (order, resume,
node-affine reads, slots, multigrid's parts) holds unchanged.

Rendering one field for a crop box (in pixels of the frame the geometry was drawn for, at the DCT
scale 1/d the frames would be decoded at, so box x d in stored pixels):

1. Crop and resize in one bilinear ``cv2.warpAffine`` of the two uint8 planes: output pixel j takes
   the field at the frame position of its centre, ``x0 + (j + 0.5) * sx`` stored pixels, which is cell
   ``x / 8 - 0.5`` (cell centres at integers; borders replicated). The planes are linear in u and v
   (128 = zero), so interpolating them interpolates the vectors. A flip reverses j in the same map.
2. Vectors in output pixels: u is multiplied by ``1 / sx`` (output pixels per stored pixel), v by
   ``1 / sy``, and u is negated under a flip, by one lookup table per plane, rounded to the nearest
   quantisation step and clipped to the stored range (q in [1, 255], +-20 output pixels per frame).
   So a disc that moves 4 stored pixels a frame moves 4 * 224 / 256 px in a 224 crop of a 256 box.

The output is 2 channels per frame (q of u, q of v, uint8, 128 = no motion); the validity plane
is not passed on: invalid cells (intra-coded blocks and frames, frame 0 of ``flow``) are stored as
zero motion, which is what the network sees of them. The model normalises with
``(q - 128) / MOTION_STD`` (``trainer.model.tsm``).
"""
from __future__ import annotations

import random

import numpy as np

from shards.format import motionfield

from ..config import CHANNELS
from .transforms import Geometry


def vector_table(factor: float) -> np.ndarray:
    """q -> the q of its vector multiplied by ``factor``, for all 256 byte values."""
    q = np.arange(256, dtype=np.float64)
    return np.clip(128 + np.rint((q - 128) * factor), 1, 255).astype(np.uint8)


def render(planes: np.ndarray, box, side: int, flip: bool, out: np.ndarray) -> None:
    """The field ``planes`` ((rows, columns, 2) uint8 q) over ``box`` (left, top, right, bottom in
    stored pixels) as a ``side`` x ``side`` field in output pixels, mirrored (u negated) when ``flip``,
    into ``out`` ((side, side, 2) uint8). See the module docstring."""
    import cv2  # the trainer's install has OpenCV; reading RGB clips needs none (docs/library.md)

    x0, y0, x1, y1 = box
    sx, sy = (x1 - x0) / side, (y1 - y0) / side  # stored pixels per output pixel
    g = motionfield.GRID
    ax, bx = sx / g, (x0 + 0.5 * sx) / g - 0.5
    if flip:  # output column j reads the column side - 1 - j would have read
        ax, bx = -ax, bx + ax * (side - 1)
    m = np.array([[ax, 0, bx], [0, sy / g, (y0 + 0.5 * sy) / g - 0.5]], dtype=np.float64)
    cv2.warpAffine(planes, m, (side, side), dst=out, flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                   borderMode=cv2.BORDER_REPLICATE)
    tables = np.stack([vector_table((-1 if flip else 1) / sx), vector_table(1 / sy)], axis=-1)
    cv2.LUT(out, tables[None], dst=out)


class MotionTransform:
    """The clip transform of a frame transform (``TrainTransform`` or ``EvalTransform``) applied to
    the clip's ``kind`` fields: same ``geometry`` draws, output (T, side, side, 2) per view."""

    channels = CHANNELS["motion"]  # u and v, the stored planes R and G

    def __init__(self, frames, kind: str):
        if kind not in motionfield.KINDS:
            raise ValueError(f"motion field kind {kind!r} not one of {motionfield.KINDS}")
        self.frames, self.kind = frames, kind
        self.views, self.side = frames.views, frames.side
        self.crop_size, self.scale_size = frames.crop_size, frames.scale_size
        self.flip = getattr(frames, "flip", False)

    def shape(self, frames: int) -> tuple[int, ...]:
        return self.frames.shape(frames)[:-1] + (self.channels,)

    def geometry(self, w: int, h: int, rng: random.Random | None) -> Geometry:
        return self.frames.geometry(w, h, rng)

    def members(self, sample: dict) -> list[tuple[bytes, bytes]]:
        """A sample's frames in order (``trainer.data.stages``), each as (its JPEG, its motion field)."""
        return list(zip(sample["frames"], sample["fields"], strict=True))

    def into(self, clip: list[tuple[bytes, bytes]], rng: random.Random | None, out: np.ndarray) -> Geometry:
        """Render ``clip`` ((JPEG, field PNG) per frame) into ``out``; the geometry drawn, in pixels of
        the frame at the DCT scale its JPEGs would be decoded at (as ``TrainTransform.into``)."""
        g, d, _ = self.frames.draw(clip[0][0], rng)
        views = out if self.views > 1 else out[None]
        for t, (_, png) in enumerate(clip):
            planes = np.ascontiguousarray(motionfield.quantised(png)[..., :self.channels])
            for box, view in zip(g.boxes, views):
                render(planes, tuple(v * d for v in box), g.side, g.flip, view[t])
        return g
