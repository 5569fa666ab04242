"""Pillow's memory for decoded frames: keep freed image blocks for reuse.

Pillow hands each freed image's memory back to the OS by default, so every decoded frame pays for
page faults on fresh memory: in ingest's decoder the copy of a 340x256 frame into its image cost
0.25 ms (four times swscale's conversion), 0.08 ms with blocks kept; in the trainer's loader,
decoding and resizing run about 1.3x faster (bench/loader). A user's PILLOW_BLOCKS_MAX still wins.
"""
from __future__ import annotations

import os

from PIL import Image


def keep_freed_blocks(count: int) -> None:
    """Keep up to ``count`` freed image blocks for reuse, unless the user set PILLOW_BLOCKS_MAX."""
    if "PILLOW_BLOCKS_MAX" not in os.environ:
        Image.core.set_blocks_max(count)
