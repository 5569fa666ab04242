"""Multigrid in the loader: parts of their own shape, shorter clips from the stored frames, decoded alone."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from shardsets import frame_colour, jpeg

from trainer.multigrid import Schedule, plan
from trainer.shapes import Part, PartsRenderer, epoch_parts, parts_nbytes, unpack

STORED = 8
PARTS = (Part(3, 2, 16), Part(2, 4, 24), Part(1, 8, 32))


def stored_clip(i: int) -> list[bytes]:
    return [jpeg(frame_colour(i, t), (64, 48)) for t in range(STORED)]


def frames_seen(clip: np.ndarray, i: int) -> list[int]:
    """Which stored frame each output frame of clip i shows, told by its colour."""
    out = []
    for frame in clip:
        mean = frame.reshape(-1, 3).mean(0)
        out.append(min(range(STORED), key=lambda t: np.abs(mean - frame_colour(i, t)).max()))
        assert np.abs(mean - frame_colour(i, out[-1])).max() < 4
    return out


def test_parts_take_every_kth_stored_frame_at_their_own_crop_and_decode_only_those():
    clips = [stored_clip(i) for i in range(6)]
    renderer = PartsRenderer(PARTS, crop_size=32, scale_size=48, flip=False)
    pixels = np.zeros(renderer.nbytes, dtype=np.uint8)
    renderer.render(clips, [random.Random(i) for i in range(6)], pixels)
    labels, valid = torch.arange(6), torch.tensor([True] * 5 + [False])
    batches = unpack(torch.from_numpy(pixels), PARTS, labels, valid)
    assert [tuple(b["clips"].shape) for b in batches] == [(3, 2, 3, 16, 16), (2, 4, 3, 24, 24), (1, 8, 3, 32, 32)]
    assert [b["labels"].tolist() for b in batches] == [[0, 1, 2], [3, 4], [5]]
    assert [b["valid"].tolist() for b in batches] == [[True] * 3, [True] * 2, [False]]
    starts, taken = set(), {}
    for b, part in zip(batches, PARTS):
        assert b["clips"].flatten(0, 1).is_contiguous(memory_format=torch.channels_last)
        stride = STORED // part.frames
        for clip, i in zip(b["clips"].movedim(-3, -1).numpy(), b["labels"].tolist()):
            seen = frames_seen(clip, i)
            assert seen == list(range(seen[0], STORED, stride)) and seen[0] < stride  # same span, coarser grid
            starts.add((stride, seen[0]))
            taken[i] = seen
    assert {s for st, s in starts if st == 4} != {0}  # the start is drawn, not always the first frame
    # frames a clip does not take are never decoded: replaced by bytes no decoder accepts, same result
    broken = [[f if t in taken[i] else b"not a jpeg" for t, f in enumerate(c)] for i, c in enumerate(clips)]
    again = np.zeros_like(pixels)
    renderer.render(broken, [random.Random(i) for i in range(6)], again)
    assert np.array_equal(again, pixels)
    with pytest.raises(ValueError, match="loader batch of 5 clips"):
        renderer.render(clips[:5], [random.Random(0)] * 5, pixels)


def test_an_epochs_parts_are_its_phases_cycle_at_the_rank_batch():
    sched = Schedule(plan(12, (5, 9), 8, 64), batch=2, world_size=2, samples=200)
    for epoch in range(sched.epochs):
        parts = epoch_parts(sched, epoch)
        phase = sched.epoch_phase[epoch]
        assert [(p.clips, p.frames, p.crop) for p in parts] == [(2 * s.factor, s.frames, s.crop) for s in phase.cycle]
        assert sum(p.clips for p in parts) == sched.period(phase)
    # the smallest shapes come first, and every part of a long-cycle shape costs about the same pixels
    first = epoch_parts(sched, 0)
    assert [p.crop for p in first] == [32, 45, 45] and {p.frames for p in first} == {2}
    assert max(p.nbytes for p in first) / min(p.nbytes for p in first) < 1.1
    assert parts_nbytes(first) == sum(p.nbytes for p in first)
