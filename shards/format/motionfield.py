"""Motion fields as stored in a shard: one small PNG per frame, ``NN.<kind>.png`` beside ``NN.jpg``.

``ingest build --motion mv|flow`` writes them; ``shards verify``, ``stats`` and the trainer read
them, so the format lives here.

* A field describes how frame ``NN`` moved from the frame before it, in pixels of the stored
  JPEG frame per source frame: ``u`` to the right, ``v`` down.
* One cell per ``GRID`` x ``GRID`` pixels of the stored frame: a W x H frame has a
  ceil(W / GRID) x ceil(H / GRID) field.
* Clipped to [-BOUND, BOUND] and quantised as TSN stores flow, but symmetric so that zero is
  exact: ``q = 128 + round(u * 127 / BOUND)`` in [1, 255]; one step is ``STEP`` = BOUND / 127
  pixels (0.157 px per frame).
* An RGB PNG: R = u, G = v, B = validity (255: the cell's motion is known; 0: not known, as for
  intra-coded frames and blocks, where the field is zero).
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

KINDS = ("mv", "flow")  # what ``ingest build --motion`` can store (besides "none")
GRID = 8
BOUND = 20.0
STEP = BOUND / 127


def member(t: int, kind: str) -> str:
    """The member suffix of frame ``t``'s field."""
    return f"{t:02d}.{kind}.png"


def grid_size(width: int, height: int) -> tuple[int, int]:
    """(columns, rows) of the field of a ``width`` x ``height`` frame."""
    return -(-width // GRID), -(-height // GRID)


def encode(field: np.ndarray, valid: np.ndarray) -> bytes:
    """PNG bytes of ``field`` (rows, columns, 2) float and ``valid`` (rows, columns) bool."""
    q = 128 + np.rint(np.clip(field, -BOUND, BOUND) * (127 / BOUND))
    q[~valid] = 128
    planes = np.dstack([q.astype(np.uint8), np.where(valid, 255, 0).astype(np.uint8)])
    buf = io.BytesIO()
    Image.fromarray(planes, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def quantised(data: bytes) -> np.ndarray:
    """The stored planes of a PNG as they are: (rows, columns, 3) uint8, q of u, q of v, validity."""
    image = Image.open(io.BytesIO(data))
    if image.mode != "RGB":
        raise ValueError(f"motion field is {image.mode}, not RGB")
    return np.asarray(image)


def decode(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(field, valid) from a stored PNG: the inverse of ``encode`` up to the quantisation."""
    planes = quantised(data)
    field = (planes[..., :2].astype(np.float32) - 128) * np.float32(STEP)
    return field, planes[..., 2] > 127
