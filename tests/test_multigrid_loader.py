"""Multigrid in the loader: parts of their own shape, shorter clips from the stored frames, decoded alone."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers.shardsets import frame_colour, jpeg, make_shardset

from shards.plan import partition as P
from trainer.data import ClipLoader, EpochOptions
from trainer.data.shapes import EpochShapes, Part, PartsRenderer, epoch_parts, parts_nbytes, unpack
from trainer.schedules.multigrid import Schedule, plan

STORED = 8
PARTS = (Part(3, 2, 16), Part(2, 4, 24), Part(1, 8, 32))


def stored_clip(i: int) -> list[bytes]:
    return [jpeg(frame_colour(i, t), (64, 48)) for t in range(STORED)]


def index_of(key: str) -> int:
    video, clip = key.split("_v")[1].split("_c")
    return int(video) * 2 + int(clip)


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
    batch = unpack({"clips": torch.from_numpy(pixels), "labels": labels, "valid": valid,
                    "keys": list("abcdef"), "global_valid": [6, 4, 1]}, PARTS)
    assert batch["global_valid"] == 11 and batch["keys"] == list("abcdef") and "clips" not in batch
    batches = batch["parts"]
    assert [b["global_valid"] for b in batches] == [6, 4, 1]
    assert [tuple(b["clips"].shape) for b in batches] == [(3, 2, 3, 16, 16), (2, 4, 3, 24, 24),
                                                          (1, 8, 3, 32, 32)]
    assert [b["labels"].tolist() for b in batches] == [[0, 1, 2], [3, 4], [5]]
    assert [b["valid"].tolist() for b in batches] == [[True] * 3, [True] * 2, [False]]
    starts, taken = set(), {}
    for b, part in zip(batches, PARTS):
        assert b["clips"].flatten(0, 1).is_contiguous(memory_format=torch.channels_last)
        stride = STORED // part.frames
        for clip, i in zip(b["clips"].movedim(-3, -1).numpy(), b["labels"].tolist()):
            seen = frames_seen(clip, i)
            # same span, coarser grid
            assert seen == list(range(seen[0], STORED, stride)) and seen[0] < stride
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
        assert [(p.clips, p.frames, p.crop) for p in parts] == [(2 * s.factor, s.frames, s.crop)
                                                                for s in phase.cycle]
        assert sum(p.clips for p in parts) == sched.period(phase)
    # the smallest shapes come first, and every part of a long-cycle shape costs about the same pixels
    first = epoch_parts(sched, 0)
    assert [p.crop for p in first] == [32, 45, 45] and {p.frames for p in first} == {2}
    assert max(p.nbytes for p in first) / min(p.nbytes for p in first) < 1.1
    assert parts_nbytes(first) == sum(p.nbytes for p in first)


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("mg"))
    make_shardset(d, {"train": 45}, per_shard=7, frames=STORED)
    return d


def test_parts_split_the_padding_of_each_global_step():
    """``step_samples`` with parts: the real clips of every part of every global batch, against
    the ranks' full position sequences."""
    order = P.epoch_order([7, 7, 7, 7, 7, 7, 3], 0, 0)
    n = len(order)
    for world, workers, cuts, done in [(2, 1, (4, 2, 1), 0), (3, 2, (2, 4), 1), (4, 1, (5,), 0)]:
        seg = P.Segment(world, workers, sum(cuts), done)
        counts = P.step_samples(n, seg, "pad", 8, 0, 0, parts=cuts)
        seqs = [P.rank_sequence(n, seg, r, "pad", 8, 0, 0) for r in range(world)]
        bounds = np.cumsum((0, *cuts))
        real = [[sum(p < n for seq in seqs for p in seq[b * seg.batch_size + a: b * seg.batch_size + z])
                 for a, z in zip(bounds, bounds[1:])] for b in range(len(counts))]
        assert counts == real and any(c != [world * k for k in cuts] for c in counts)  # padding somewhere
        assert P.step_samples(n, seg, "pad", 8, 0, 0) == [sum(c) for c in counts]
    with pytest.raises(ValueError, match="add up"):
        P.step_samples(n, P.Segment(2, 1, 7), "pad", 8, 0, 0, parts=(3, 3))


def test_the_loader_yields_the_schedules_parts_on_every_rank_and_resumes_mid_epoch(shardset):
    """Two ranks over two multigrid epochs of different parts: equal batches on both ranks, the
    epoch's parts in order, shorter clips from every k-th stored frame, each clip once per epoch;
    a loader restored from a mid-epoch state continues with the identical batches."""
    sched = Schedule(plan(4, (2,), STORED, 32, long_cycle=True, short_cycle=True), batch=1, world_size=2,
                     samples=45)
    shapes = EpochShapes(sched)
    assert shapes.parts(0) != shapes.parts(sched.epochs - 1)

    def loader(rank):
        return ClipLoader(shardset, "train", EpochOptions(batch_size=1, rank=rank, world_size=2,
                                                          shuffle_buffer=4,
                                                          shapes=shapes), num_workers=1, crop_size=32,
                          scale_size=48, flip=False)

    for epoch in (0, sched.epochs - 1):
        parts = epoch_parts(sched, epoch)
        runs = []
        for rank in (0, 1):
            ld = loader(rank)
            ld.set_epoch(epoch)
            runs.append(list(ld))
        assert len(runs[0]) == len(runs[1]) == sched.iterations[epoch] // len(parts)
        keys = []
        for batch in runs[0] + runs[1]:
            assert [tuple(p["clips"].shape)
                    for p in batch["parts"]] == [(p.clips, p.frames, 3, p.crop, p.crop) for p in parts]
            for part, spec in zip(batch["parts"], parts):
                i = index_of(batch["keys"][0]) if spec is parts[0] else None
                if i is not None and bool(part["valid"][0]):
                    seen = frames_seen(part["clips"][0].movedim(-3, -1).numpy(), i)
                    assert seen == list(range(seen[0], STORED, STORED // spec.frames))
            keys += [k for k, ok in zip(batch["keys"], batch["valid"].tolist()) if ok]
            assert sum(p["global_valid"] for p in batch["parts"]) == batch["global_valid"]
        assert sorted(keys) == sorted(set(keys)) and len(keys) == 45
    # resume: a mid-epoch state continues with the same batches, parts and pixels
    ld = loader(1)
    ld.set_epoch(sched.epochs - 1)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    rest = list(it)
    again = loader(1)
    again.load_state_dict(state)
    resumed = list(again)
    assert [b["keys"] for b in resumed] == [b["keys"] for b in rest] and rest
    for a, b in zip(rest, resumed):
        assert all(torch.equal(x["clips"], y["clips"]) for x, y in zip(a["parts"], b["parts"]))
    # validation always at the full shape: an evaluation loader has no parts
    val = ClipLoader(shardset, "train", EpochOptions(batch_size=3, train=False, shapes=shapes),
                     num_workers=0, crop_size=32, scale_size=36)
    assert {tuple(b["clips"].shape) for b in val} == {(3, STORED, 3, 32, 32)}


def test_resize_splits_the_rest_of_the_epoch_for_a_larger_batch(shardset):
    ld = ClipLoader(shardset, "train", EpochOptions(batch_size=2, shuffle_buffer=4), num_workers=1,
                    crop_size=32, scale_size=48)
    it = iter(ld)
    first = [next(it) for _ in range(3)]
    it.close()
    ld.resize(8)
    rest = list(ld)
    assert {len(b["keys"]) for b in rest} == {8} and tuple(rest[0]["clips"].shape[:2]) == (8, STORED)
    keys = [k for b in first + rest for k, ok in zip(b["keys"], b["valid"].tolist()) if ok]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 45
    assert ld.slots.fits((8, STORED, 32, 32, 3))
