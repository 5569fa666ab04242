"""What the rank makes of a loader worker's batch: the pixels leased from their batch slot
(``trainer.data.slots``), labels and validity as tensors, each clip's video; and the bad-sample budget
the batches' lists of what they left out are counted against (``ClipLoader``'s ``max_bad_samples``).

Bad samples (bytes that differ from the manifest's digest, read twice: ``shards.format.digests``): by
default the first ends the iteration with its ``CorruptSample``, a ``DataFault`` naming the shard,
the sample, both digests and the URL. With ``max_bad_samples`` (N, or None: the caller keeps the
budget, as ``trainer.bad_samples`` does over every rank) the loader goes on without them: a bad
sample's place in its batch is taken by a repeat of a good clip of the same worker (the one before
it, or for the first ones the one after), marked ``valid`` False as a padding repeat is, so every
rank still yields the same batches of the same size and every good clip is read once; the batch's
``bad`` lists what was left out (``url``, ``shard``, ``key``, ``index`` in the shard, ``clip``: its
position in the split, as the viewer numbers clips, ``split``, ``expected`` and ``found`` digests,
``rank``, ``slot`` in the batch). A bad sample met again as a padding repeat is left out unlisted.
Past N in an epoch the iteration ends with ``TooManyBadSamples`` before the batch that went over.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from shards.format.digests import TooManyBadSamples
from shards.format.manifest import ShardInfo
from shards.format.sample import video_of

from .slots import SlotPool

log = logging.getLogger(__name__)


def received(sent: dict, pool: SlotPool | None, parts=None) -> dict:
    """A batch in the trainer's process from what a worker sent: pixels from its slot; ``parts``: a
    multigrid batch's (flat pixels, cut by ``shapes.unpack``)."""
    if "slot" in sent:
        sent["clips"] = pool.lease(sent.pop("slot"), sent.pop("shape"))
    elif "clips" in sent and pool is not None:
        pool.misses += 1
        if pool.misses == 1:
            log.info("batch slots: a batch came in memory of its own, all %d slots of its worker were "
                     "held (the caller keeps batches) or too small", pool.per_worker)
    if "clips" in sent and not parts:
        sent["clips"] = sent["clips"].movedim(-1, -3)  # a view: channels-last memory
    return {**sent, "labels": torch.tensor(sent["labels"], dtype=torch.int64),
            "videos": [video_of(k) for k in sent["keys"]],
            "valid": torch.tensor(sent["valid"], dtype=torch.bool)}


class BadSamples:
    """The bad samples one rank met in an epoch of ``split`` (``shards``: its manifest entries), against
    ``limit`` (None: no limit, the caller keeps the budget)."""

    def __init__(self, limit: int | None, split: str, shards: list[ShardInfo]):
        self.limit, self.split, self.shards, self.met = limit, split, shards, 0
        self._clip_starts = None  # shard name -> its first clip's position in the split (made when needed)

    def count(self, found: list[dict], epoch: int, rank: int) -> None:
        """What a batch left out, completed with where it is (its clip in the split, ``rank``) and
        counted; past the limit this epoch: ``TooManyBadSamples``."""
        if not found:
            return
        if self._clip_starts is None:
            self._clip_starts = dict(zip((s.name for s in self.shards),
                                         np.cumsum([0] + [s.num_samples for s in self.shards]).tolist()))
        for record in found:
            record |= {"split": self.split, "clip": self._clip_starts[record["shard"]] + record["index"],
                       "rank": rank}
        self.met += len(found)
        if self.limit is not None and self.met > self.limit:
            raise TooManyBadSamples(f"{self.met} bad samples in epoch {epoch + 1} of {self.split} on rank "
                                    f"{rank}, more than max_bad_samples={self.limit}; the last: "
                                    f"{found[-1]['line']}")
