"""The range of every numeric build option: one table for ``ingest build``'s flags and the HTTP
build API (``service.builds``), so both refuse the same values, before any work, in one line
naming the option and its range (a ``--short-side`` of 99999999999 once reached every video's
decode and failed each with an ``OverflowError``). ``ClipConfig`` checks its fields against it,
so a build started from Python refuses them too."""
from __future__ import annotations

import argparse

from shards.base.commands import byte_size, number_in_range

BOUNDS = {"frames": (1, 64), "clips_per_video": (1, 64), "eval_clips": (1, 64), "short_side": (16, 2048),
          "quality": (1, 100), "restart_interval": (0, 1024), "seed": (0, 2**63 - 1),
          "videos_per_task": (1, 1024), "ffmpeg_threads": (1, 16), "timeout": (1, 3600),
          "shard_samples": (1, 10**6), "shard_size": (10**6, 2**36)}


def flag(option: str, kind=int):
    """The argparse ``type=`` of ``option``: a ``kind`` inside its bounds."""
    return number_in_range(kind, *BOUNDS[option])


def size_flag(option: str):
    """The argparse ``type=`` of a size ``option`` (``64MB``, ``1GiB``: ``byte_size``) inside its bounds."""
    check = flag(option)

    def size(text: str) -> int:
        value = byte_size(text)
        try:
            return check.in_range(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return size


def check(option: str, value) -> None:
    """``ValueError`` naming ``option`` when ``value`` is outside its bounds."""
    low, high = BOUNDS[option]
    if not low <= value <= high:  # NaN is in no range
        raise ValueError(f"{option}: {value!r} is outside {low}..{high}")
