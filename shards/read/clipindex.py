"""Clips of a shard set by position, answered from the manifest alone.

Clip ``n`` of a split is the n-th sample in manifest order: shards in their listed order,
samples in their order inside each shard. A ``ClipIndex`` turns the manifest into a few numpy
arrays per split (each clip's label, each shard's first position), so that "which shard and
sample hold clip n", "the clips of these classes" and "clips per class" cost microseconds to
a few milliseconds on a Kinetics-sized set (240,000 clips) with no I/O: the service's viewer
pages and filters with it, and ``shards preview`` picks its clips with it.

``read_clip`` reads a clip's sample as the loader does (``shards.format.sample``); its ``spans`` say
where each frame lies in the shard, so a frame is read or served as a byte range.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..format.manifest import Manifest, ShardInfo, SplitInfo
from ..format.sample import Sample
from .reading import iter_samples


@dataclass(frozen=True)
class Clip:
    split: str
    n: int  # position in the split
    shard: ShardInfo
    index: int  # position in the shard

    @property
    def key(self) -> str:
        return self.shard.keys[self.index]

    @property
    def label(self) -> int:
        return self.shard.labels[self.index] if self.index < len(self.shard.labels) else -1

    @property
    def offset(self) -> int:
        return self.shard.offsets[self.index]

    @property
    def length(self) -> int:
        return self.shard.lengths[self.index]


class SplitClips:
    """The clips of one split, by position."""

    def __init__(self, name: str, split: SplitInfo):
        self.name, self.shards = name, split.shards
        counts = [s.num_samples for s in split.shards]
        self.starts = np.cumsum([0] + counts)
        labels = np.full(int(self.starts[-1]), -1, dtype=np.int32)
        for start, shard in zip(self.starts, split.shards):
            known = shard.labels[:shard.num_samples]
            labels[start:start + len(known)] = known
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def clip(self, n: int) -> Clip:
        if not 0 <= n < len(self):
            raise IndexError(f"split {self.name} has {len(self)} clips; there is no clip {n}")
        k = int(np.searchsorted(self.starts, n, side="right")) - 1
        return Clip(self.name, n, self.shards[k], n - int(self.starts[k]))

    def matching(self, labels: Sequence[int] | None = None) -> np.ndarray:
        """Positions, ascending, of the clips whose label is one of ``labels`` (all: None)."""
        if labels is None:
            return np.arange(len(self))
        return np.flatnonzero(np.isin(self.labels, np.asarray(labels, dtype=np.int32)))

    def histogram(self, num_classes: int) -> np.ndarray:
        """Clips per class index (unlabeled clips not counted)."""
        return np.bincount(self.labels[self.labels >= 0], minlength=num_classes)


class ClipIndex:
    """Every split of a manifest as ``SplitClips``."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.classes = manifest.classes
        self.splits = {name: SplitClips(name, split) for name, split in manifest.splits.items()}

    def class_index(self, name: str) -> int:
        try:
            return self.classes.index(name)
        except ValueError:
            raise KeyError(f"no class {name!r} in the set (it has {len(self.classes)})") from None

    def split(self, name: str) -> SplitClips:
        if name not in self.splits:
            raise KeyError(f"no split {name!r} (the set has {', '.join(self.splits) or 'none'})")
        return self.splits[name]

    def frames_per_clip(self) -> int | None:
        """T, as the build recorded it (None for sets whose manifest does not say)."""
        frames = self.manifest.config.get("clip", {}).get("frames")
        return frames if isinstance(frames, int) else None


def read_clip(manifest: Manifest, clip: Clip) -> Sample:
    """The clip's sample, read as one byte range of its shard (any URL the loader reads), checked
    against the manifest's digest and parsed by the format's schema as the loader reads it: a
    ``CorruptSample`` or ``BadSample`` when it is damaged."""
    ((_, sample),) = iter_samples(manifest.shard_url(clip.shard), clip.shard, clip.index, clip.index + 1,
                                  frames=manifest.frames, motion=manifest.motion)
    return sample
