"""Rotating pre-sampled clips: one of each video's stored clips an epoch (``stored_clips="rotate"``); pure.

``ingest build --clips-per-video K`` stores K samplings of each training video as K samples keyed
``<video>_c<NN>`` (``shards.format.sample.clip_key``), each placed by a hash of its key, so a video's
clips lie in different shards. Read as they are (``"each"``), every stored clip is a sample of every
epoch: an epoch is K views of each video, K times the steps. Rotating, an epoch is one view of each
video whatever K is, and K buys sampling diversity across epochs instead of longer epochs:

1. the split's clips grouped by video (``video_of`` their keys), each video's in key order (clip 0, 1, ...);
2. epoch e reads clip e mod K_v of video v (K_v: its stored clips), so any K_v consecutive epochs read
   each stored clip once (the training clips are independent random samplings: which one comes first
   does not matter);
3. the epoch's orders (``shards.plan.partition``: shards shuffled, or each node's own) keep their order and
   lose the clips not chosen (``select``); the split of the rest among ranks and workers, the padding,
   the shuffle buffer and the resume are the planner's as for any order.
"""
from __future__ import annotations

import numpy as np

from shards.format.manifest import ShardInfo
from shards.format.sample import video_of
from shards.plan import partition


class Rotation:
    """Which stored clips epoch e reads, for the split ``shards`` (module docstring)."""

    def __init__(self, shards: list[ShardInfo]):
        self.starts = np.cumsum([0] + [s.num_samples for s in shards])  # each shard's first clip in the split
        by_video: dict[str, list[tuple[str, int]]] = {}
        for i, key in enumerate(k for s in shards for k in s.keys):
            by_video.setdefault(video_of(key), []).append((key, i))
        clips = [sorted(members) for members in by_video.values()]
        self.members = np.array([i for members in clips for _, i in members], dtype=np.int64)
        self.counts = np.array([len(members) for members in clips], dtype=np.int64)
        self.firsts = np.cumsum(self.counts) - self.counts

    @property
    def videos(self) -> int:
        """Clips an epoch reads: one a video."""
        return len(self.counts)

    def chosen(self, epoch: int) -> np.ndarray:
        """One bool per clip of the split: whether epoch ``epoch`` reads it."""
        mask = np.zeros(int(self.starts[-1]), dtype=bool)
        mask[self.members[self.firsts + epoch % self.counts]] = True
        return mask

    def select(self, orders: list[partition.Order], epoch: int) -> list[partition.Order]:
        """``orders`` with only the clips epoch ``epoch`` reads, in the same order."""
        mask = self.chosen(epoch)
        return [partition.Order(r for run in order.runs
                                for r in partition.kept(run, mask[self.starts[run.shard] + run.start:
                                                                  self.starts[run.shard] + run.stop]))
                for order in orders]


def clips_an_epoch(shards: list[ShardInfo], stored_clips: str) -> int:
    """Clips a whole training epoch of the split ``shards`` reads: every stored clip (``"each"``), or one a
    video (``"rotate"``)."""
    return Rotation(shards).videos if stored_clips == "rotate" else sum(s.num_samples for s in shards)
