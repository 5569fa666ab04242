"""The loader's shared-memory batch slots (``trainer.data.slots``): reused batch after batch and
epoch after epoch, and never written while the trainer still holds the batch in them."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.shardsets import frame_colour, make_shardset

from trainer.data import ClipLoader, EpochOptions

CLIPS = 24


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("slots"))
    make_shardset(d, {"train": CLIPS}, per_shard=6, frames=4)
    return d


def loader(shardset, workers):
    return ClipLoader(shardset, "train", EpochOptions(batch_size=2, shuffle_buffer=6), num_workers=workers,
                      crop_size=32, scale_size=48)


def in_pool(ld, clips) -> bool:
    start = ld.slots.memory.data_ptr()
    return start <= clips.data_ptr() < start + ld.slots.memory.numel()


def matches_its_keys(batch) -> bool:
    """Every frame of every clip has the solid colour its key stands for (see shardsets)."""
    for clip, key in zip(batch["clips"].numpy(), batch["keys"]):
        video, c = key.split("_v")[1].split("_c")
        i = int(video) * 2 + int(c)
        if any(np.abs(clip[t].reshape(3, -1).mean(1) - frame_colour(i, t)).max() > 4
               for t in range(len(clip))):
            return False
    return True


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loop_reuses_the_same_slots_every_epoch(shardset, workers):
    ld = loader(shardset, workers)
    seen = set()
    for _ in range(2):
        for batch in ld:
            assert in_pool(ld, batch["clips"]) and matches_its_keys(batch)
            seen.add(batch["clips"].data_ptr())
    pool = ld.slots
    assert pool.misses == 0 and len(seen) <= pool.workers * pool.per_worker < 2 * len(ld)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_held_batch_is_never_overwritten_while_newer_ones_arrive(shardset, workers):
    """Keep every second batch (far more than the pool has slots), drop the others: the kept ones
    still hold exactly the pixels they arrived with when the epoch is over."""
    ld = loader(shardset, workers)
    held = []
    for n, batch in enumerate(ld):
        assert matches_its_keys(batch)
        if n % 2 == 0:
            held.append((batch, batch["clips"].clone()))
    assert all(np.array_equal(b["clips"], copy) for b, copy in held)
    assert all(matches_its_keys(b) for b, _ in held)
    pool = ld.slots
    assert sum(in_pool(ld, b["clips"]) for b, _ in held) >= 2  # slots were held, not copied ...
    assert pool.misses > 0  # ... and the workers ran out of free ones


def test_an_interrupted_epoch_gives_its_slots_back(shardset):
    ld = loader(shardset, 2)
    it = iter(ld)
    first = next(it)
    it.close()  # workers stop with batches in flight
    assert ld.slots.leased == {int(np.flatnonzero(ld.slots.state)[0])}  # only the batch still held
    del first
    assert not ld.slots.state.any()
    rest = list(b["keys"] for b in ld)
    assert len(rest) == len(ld.__class__(shardset, "train", EpochOptions(batch_size=2, shuffle_buffer=6),
                                         num_workers=2, crop_size=32, scale_size=48)) - 1
