"""Motion fields of the sampled frames (``ingest build --motion``), in ``shards.format.motionfield``'s terms.

``mv``: the codec's motion vectors, which the decoder exports from the decode the frames already
need (``flags2=+export_mvs``; FFmpeg's ``AVMotionVector`` as frame side data), so no frame is
decoded for them (MPEG-4 Part 2: one more packet per video, and its B-frames take a reference's
field; see ``ingest.decode.pyav_decoder``):

1. Every vector moves a block of ``w`` x ``h`` coded pixels centred on ``dst``; its content comes
   from ``src = dst + motion / motion_scale`` in a reference frame, in the past (``source`` < 0)
   or, for B-frames, in the future (``source`` > 0).
2. A vector is divided by the distance, in displayed frames, to the reference it names, giving
   a velocity in pixels per frame: ``(dst - src) / back`` for a past reference and
   ``(src - dst) / forward`` for a future one (constant motion). The side data do not say which
   reference a block used; it is taken to be the nearest one (reference index 0, what encoders
   pick most often): the nearest reference frame displayed before (after) the frame among those
   decoded before it (``reference_distances``, from the packet index).
3. A bi-predicted block has one vector per reference: its velocity is their mean.
4. The velocities are laid on a grid of 4 x 4 coded pixels (H.264's smallest partition), then
   area-averaged onto the stored field's grid of ``GRID`` x ``GRID`` output pixels, scaled to
   output pixels and turned with the frame. A cell is valid when at least half its area is
   inter-predicted. Intra blocks and intra frames have no motion: zero, marked invalid, rather
   than the nearest P-frame's field, which would need a frame the picks do not decode and
   would claim motion where the codec measured none.

Only some decoders export vectors (found with PyAV 18 on FFmpeg 7: ``VECTOR_CODECS``): H.264,
MPEG-4 Part 2, MPEG-1 and MPEG-2, and the H.263 family. VP8, VP9, HEVC, AV1 and MJPEG export
none, so their fields would be all unknown: each such video is a ledger warning
(``no motion vectors``), and ``--motion flow`` computes the motion from the frames instead.

``flow``: dense optical flow (OpenCV's DIS, preset medium; see BENCHMARKS.md for DIS against
Farneback) from the frame before the sampled one to it, on the stored frames' gray levels,
area-averaged onto the same grid. It needs the frame before each pick: one more frame per
pick (``with_previous``). The first frame of a video has no frame before it: invalid.
"""
from __future__ import annotations

import cv2
import numpy as np

from shards.format.motionfield import grid_size

from .packets import Packet

CELL = 4  # coded pixels per side of the grid the vectors are first laid on
MOTIONS = ("none", "mv", "flow")
# FFmpeg's decoders that export motion vectors (flags2=+export_mvs), by codec name: the H.264 and the
# MPEG video decoders (tests/test_motion.py decodes each codec of the test media to see)
VECTOR_CODECS = frozenset({"h264", "mpeg4", "mpeg1video", "mpeg2video", "h263", "h263p", "flv", "msmpeg4v2",
                           "msmpeg4v3", "wmv1", "wmv2"})


def reference_distances(index: list[Packet], order: list[int],
                        picks: list[int]) -> dict[int, tuple[int | None, int | None]]:
    """Display index of each pick -> (frames back to its past reference, frames forward to its
    future one), None where it has none: the nearest reference frames in display order among
    those decoded before it. ``index``: the packets in decode order; ``order``: decode index of
    each displayed frame."""
    shown_at = {k: d for d, k in enumerate(order)}
    out = {}
    for d in picks:
        refs = [shown_at[j] for j in range(order[d]) if index[j].reference and j in shown_at]
        back = max((r for r in refs if r < d), default=None)
        ahead = min((r for r in refs if r > d), default=None)
        out[d] = (None if back is None else d - back, None if ahead is None else ahead - d)
    return out


def stand_ins(index: list[Packet], order: list[int],
              distances: dict[int, tuple[int | None, int | None]]) -> dict[int, list[int]]:
    """Display index of each pick that is not a reference frame (an MPEG-4 Part 2 B-frame) -> the
    display indices of its references, future first then past, the first of which with vectors
    stands in for it (see ``ingest.decode.pyav_decoder``)."""
    return {d: [d + ahead for ahead in (forward,) if ahead] + [d - back for back in (back,) if back]
            for d, (back, forward) in distances.items() if not index[order[d]].reference}


def coded_velocity(vectors: np.ndarray | None, width: int, height: int,
                   distances: tuple[int | None, int | None]) -> tuple[np.ndarray, np.ndarray]:
    """(velocity (rows, columns, 2), inter-coded (rows, columns) bool) on the 4 x 4 coded-pixel
    grid of a ``width`` x ``height`` frame, from its motion vectors (steps 2 and 3; None: an
    intra frame)."""
    rows, cols = -(-height // CELL), -(-width // CELL)
    scale = np.zeros(0 if vectors is None else len(vectors))  # per vector: sign / reference distance
    for source, distance, sign in ((-1, distances[0], -1.0), (1, distances[1], 1.0)):
        if distance and vectors is not None:
            scale[vectors["source"] == source] = sign / distance
    used = scale != 0
    if not used.any():
        return np.zeros((rows, cols, 2)), np.zeros((rows, cols), bool)
    # plain arrays of the fields used (a structured array's indexing is slow)
    w, h, dst_x, dst_y, mx, my, ms = (vectors[f][used].astype(np.int64) for f in
                                      ("w", "h", "dst_x", "dst_y", "motion_x", "motion_y", "motion_scale"))
    velocity = np.stack([mx, my], 1) * (scale[used] / np.maximum(ms, 1))[:, None]
    # every vector's block as the 4 x 4 cells it covers, cell k of a block at (k % nx, k // nx)
    nx, ny = np.maximum(w // CELL, 1), np.maximum(h // CELL, 1)
    per = nx * ny
    owner = np.repeat(np.arange(len(w)), per)
    k = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)
    x, y = (dst_x - w // 2) // CELL, (dst_y - h // 2) // CELL
    x, y = x[owner] + k % nx[owner], y[owner] + k // nx[owner]
    inside = (y >= 0) & (y < rows) & (x >= 0) & (x < cols)
    flat, owner = (y * cols + x)[inside], owner[inside]
    count = np.bincount(flat, minlength=rows * cols)
    total = np.stack([np.bincount(flat, velocity[owner, c], rows * cols) for c in (0, 1)], 1)
    inter = count > 0
    total[inter] /= count[inter][:, None]
    return total.reshape(rows, cols, 2), inter.reshape(rows, cols)


def to_output_grid(velocity: np.ndarray, valid: np.ndarray, coded: tuple[int, int], scaled: tuple[int, int],
                   rotation: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 4: a field on the coded 4 x 4 grid onto the stored frame's grid: area-averaged over
    the valid cells, in pixels of the frame scaled to ``scaled`` (before turning), turned
    ``rotation`` degrees counter-clockwise as the frame is."""
    size = grid_size(*scaled)
    weight = valid.astype(np.float32)
    area = cv2.resize(weight, size, interpolation=cv2.INTER_AREA)
    summed = cv2.resize((velocity * weight[..., None]).astype(np.float32), size, interpolation=cv2.INTER_AREA)
    field = np.where(area[..., None] > 0, summed / np.maximum(area, 1e-6)[..., None], 0)
    field = field * np.array([scaled[0] / coded[0], scaled[1] / coded[1]], np.float32)
    return turn(field.astype(np.float32), area >= 0.5, rotation)


def turn(field: np.ndarray, valid: np.ndarray, rotation: int) -> tuple[np.ndarray, np.ndarray]:
    """A field turned ``rotation`` degrees counter-clockwise, its vectors with it."""
    for _ in range(rotation // 90 % 4):
        field = np.rot90(field)
        field = np.dstack([field[..., 1], -field[..., 0]])  # (u, v) -> (v, -u) on screen, y down
        valid = np.rot90(valid)
    return np.ascontiguousarray(field), np.ascontiguousarray(valid)


def with_previous(picks: list[int]) -> list[int]:
    """The frames ``flow`` needs: each pick and the frame before it."""
    return sorted({i for p in picks for i in (p - 1, p) if i >= 0})


_DIS = None


def flow(previous: np.ndarray, current: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DIS flow from ``previous`` to ``current`` (H x W x 3 or 4 RGB(X) uint8) on the stored grid."""
    global _DIS
    if _DIS is None:
        _DIS = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)
    a, b = (cv2.cvtColor(np.ascontiguousarray(f[..., :3]), cv2.COLOR_RGB2GRAY) for f in (previous, current))
    dense = _DIS.calc(a, b, None)
    field = cv2.resize(dense, grid_size(a.shape[1], a.shape[0]), interpolation=cv2.INTER_AREA)
    return field, np.ones(field.shape[:2], bool)


def nothing(width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """The field of a frame with no known motion: zero, invalid."""
    cols, rows = grid_size(width, height)
    return np.zeros((rows, cols, 2), np.float32), np.zeros((rows, cols), bool)
