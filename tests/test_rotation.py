"""Rotating pre-sampled clips (``stored_clips="rotate"``, ``trainer.data.rotation``): an epoch reads one
clip of every video, each stored clip once every K epochs, in equal batches on every rank, over world
sizes, worker counts, node-affine epochs and uneven clip counts (the planner alone, pure); and the
loaders read those clips and resume the identical sequence (``ClipLoader``'s ``state_dict``, as the
trainer saves it, and ``ClipDataset`` under ``StatefulDataLoader``), elastically too."""
from __future__ import annotations

from collections import Counter
from math import lcm

import pytest
from helpers.shardsets import make_shardset

from shards.format.manifest import ShardInfo
from shards.format.ordering import shuffled
from shards.format.sample import clip_key, video_of
from trainer.data.epochs import EpochOptions, Epochs

SAMPLE = 100  # bytes a sample takes in the planner's sets


def stored(clips: list[int], per_shard: int) -> list[ShardInfo]:
    """A split of len(clips) videos, video v with clips[v] stored clips, placed by a hash of the key (as
    ingest build places them) in shards of ``per_shard``."""
    keys = shuffled([clip_key(f"v{v:03d}", k) for v, n in enumerate(clips) for k in range(n)], 11)
    out = []
    for s, start in enumerate(range(0, len(keys), per_shard)):
        part = keys[start:start + per_shard]
        out.append(ShardInfo(f"train-{s:05d}.tar", len(part), SAMPLE * len(part), "0" * 64, keys=part,
                             offsets=[SAMPLE * i for i in range(len(part))], lengths=[SAMPLE] * len(part),
                             labels=[-1] * len(part)))
    return out


def planner(shards, rank: int, world_size: int, workers: int, batch: int, local_size: int = 1,
            shuffle: str = "global") -> Epochs:
    options = EpochOptions(batch_size=batch, rank=rank, world_size=world_size, local_size=local_size,
                           train=True, seed=3, shuffle_buffer=4, shuffle=shuffle, stored_clips="rotate")
    return Epochs(shards, "train", options, workers)


def batches(ep: Epochs) -> list[list[tuple[str, bool]]]:
    """The rank's remaining batches of the current epoch as (key, valid) rows, from its workers' plans
    (batch b from worker b % workers, as the DataLoader collects them)."""
    plans = ep.worker_plans([s.name for s in ep.shards])
    rows = []
    for plan in plans:
        key_of = {i: k for k, i in plan.expected if i is not None}
        rows.append([(key_of[i], i < plan.valid_locals) for i in plan.order])
    batch, out = ep.batch_size, []
    for b in range(len(ep)):
        w, j = b % ep.workers, b // ep.workers
        out.append(rows[w][j * batch:(j + 1) * batch])
    return out


def epoch(shards, epoch_: int, world_size: int, workers: int, batch: int, local_size: int = 1,
          shuffle: str = "global") -> list[list[list[tuple[str, bool]]]]:
    """Every rank's batches of epoch ``epoch_``."""
    out = []
    for rank in range(world_size):
        ep = planner(shards, rank, world_size, workers, batch, local_size, shuffle)
        ep.set_epoch(epoch_)
        out.append(batches(ep))
    return out


LAYOUTS = [(1, 1, 4, 1, "global"), (3, 2, 2, 1, "global"), (4, 3, 5, 2, "node"), (6, 1, 1, 3, "node")]


@pytest.mark.parametrize("clips", [[4] * 30, [1 + v % 3 for v in range(29)]], ids=["K=4", "K=1..3"])
@pytest.mark.parametrize("world_size,workers,batch,local_size,shuffle", LAYOUTS)
def test_an_epoch_reads_every_video_once_and_k_epochs_every_stored_clip_once(
        clips, world_size, workers, batch,
                                                                            local_size, shuffle):
    shards = stored(clips, per_shard=7)
    every = {k for s in shards for k in s.keys}
    period = lcm(*set(clips))
    read = Counter()
    for e in range(period):
        ranks = epoch(shards, e, world_size, workers, batch, local_size, shuffle)
        assert len({len(r) for r in ranks}) == 1, "ranks with different batch counts"
        assert all(len(b) == batch for r in ranks for b in r)
        valid = [k for r in ranks for b in r for k, ok in b if ok]
        assert sorted(video_of(k) for k in valid) == sorted({video_of(k) for k in every}), f"epoch {e}"
        read.update(valid)
    assert set(read) == every
    assert all(read[k] == period // clips[int(video_of(k)[1:])] for k in every)  # each once every K_v epochs


def test_rotation_changes_the_clip_of_each_video_every_epoch_and_keeps_reads_whole():
    shards = stored([4] * 30, per_shard=40)  # 3 shards
    seen = [{k for r in epoch(shards, e, 1, 1, 5) for b in r for k, ok in b if ok} for e in range(4)]
    assert all(not a & b for i, a in enumerate(seen) for b in seen[i + 1:])
    ep = planner(shards, 0, 1, 1, 5)
    (plan,) = ep.worker_plans([s.name for s in shards])
    # a quarter of each shard's clips, a few apart: one read of each shard's part, not one a clip
    assert len(plan.reads) <= len(shards) + 1 and len(ep) * 5 == 30


def test_a_rotating_position_resumes_elastically_every_remaining_clip_once():
    shards = stored([2 + v % 3 for v in range(40)], per_shard=9)
    first = planner(shards, 0, 2, 2, 3)
    first.set_epoch(5)
    first.position.done = 3
    done = []
    for rank in range(2):
        ep = planner(shards, rank, 2, 2, 3)
        ep.set_epoch(5)
        done += [k for b in batches(ep)[:3] for k, ok in b if ok]
    rest = [k for rank in range(3) for b in batches(_at(shards, rank, 3, 1, 2, first.state_dict()))
            for k, ok in b if ok]
    chosen = {k for r in epoch(shards, 5, 1, 1, 1) for b in r for k, _ in b}
    assert Counter(done + rest) == Counter(chosen)  # every clip of epoch 5's rotation once


def _at(shards, rank: int, world_size: int, workers: int, batch: int, state: dict) -> Epochs:
    ep = planner(shards, rank, world_size, workers, batch)
    ep.load_state_dict(state)
    return ep


# --- the loaders, on real shards -------------------------------------------------------------------
CLIPS, BATCH = 22, 4  # 11 videos of 2 clips (tests/helpers/shardsets.py), in shards of 5


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    d = tmp_path_factory.mktemp("set")
    make_shardset(str(d), {"train": CLIPS}, per_shard=5)
    return str(d)


def keys(batch) -> list[tuple[str, bool]]:
    return list(zip(batch["keys"], batch["valid"].tolist()))


def ready(shardset, **options):
    from trainer.data import ClipLoader

    return ClipLoader(shardset, "train", EpochOptions(batch_size=BATCH, seed=5, shuffle_buffer=8,
                                                      stored_clips="rotate"),
                      num_workers=2, crop_size=32, scale_size=40, **options)


def test_the_loader_reads_one_clip_a_video_an_epoch_and_resumes_the_identical_sequence(shardset):
    whole = ready(shardset)
    run = [[keys(b) for b in whole] for _ in range(2)]
    for e, batches_ in enumerate(run):
        valid = [k for b in batches_ for k, ok in b if ok]
        assert (len(batches_) == 3 and sorted(video_of(k)
                                              for k in valid) == [f"train_v{v:04d}" for v in range(11)])
        # tests/helpers/shardsets.py's clips in video order: c00, then c01
        assert {k[-3:] for k in valid} == {f"c{e:02d}"}
    for after in (1, 2, 3):
        first = ready(shardset)
        it = iter(first)
        got = [keys(next(it)) for _ in range(after)]
        state = first.state_dict()
        del it, first
        again = ready(shardset)
        again.load_state_dict(state)
        got += [keys(b) for b in again]
        if after < 3:
            got += [keys(b) for b in again]
        assert got == run[0] + run[1], f"another sequence after stopping at batch {after}"


def test_a_stateful_dataloader_resumes_a_rotating_dataset_exactly(shardset):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from trainer.data import ClipDataset

    def loader():
        dataset = ClipDataset(shardset, "train", batch_size=BATCH, frames="jpeg", seed=5, shuffle_buffer=8,
                              stored_clips="rotate")
        return StatefulDataLoader(dataset, batch_size=BATCH, num_workers=2, collate_fn=ClipDataset.collate)

    whole = loader()
    run = [keys(b) for _ in range(2) for b in whole]
    same = ready(shardset)
    assert run == [keys(b) for _ in range(2) for b in same]  # the ready loader's sequence
    for after in (1, 4):
        first = loader()
        it = iter(first)
        got = []
        for _ in range(after):
            try:
                got.append(keys(next(it)))
            except StopIteration:
                it = iter(first)
                got.append(keys(next(it)))
        state = first.state_dict()
        del it, first
        again = loader()
        again.load_state_dict(state)
        got += [keys(b) for b in again]
        if after < 3:
            got += [keys(b) for b in again]
        assert got == run, f"another sequence after stopping at batch {after}"


def test_the_trainers_flag_reaches_the_loader(shardset):
    from trainer import config
    from trainer.data import ClipLoader
    from trainer.data.arguments import loader_kwargs
    from trainer.data.rotation import clips_an_epoch

    data = config.Data(data=shardset, batch_size=BATCH, crop_size=32, scale_size=40, val_split="", workers=0,
                       stored_clips="rotate")
    planning, reading = loader_kwargs(data)
    loader = ClipLoader(shardset, "train", EpochOptions(**planning, seed=5), **reading)
    assert len(loader) == 3 and "one of each video's an epoch (11 videos, rotating)" in loader.describe()
    assert clips_an_epoch(loader.shards, "rotate") == 11 and clips_an_epoch(loader.shards, "each") == CLIPS
