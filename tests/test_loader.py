"""ClipLoader on real shards: exact epochs for many world sizes, determinism, resume, elastic
resume, HTTP, the node-local cache, and the TSM transforms."""
import io
import os
import random
import shutil
from collections import Counter

import numpy as np
import pytest
import torch
from helpers.shardsets import clip_loader, frame_colour, make_shardset, serve
from PIL import Image

from shards.format.manifest import Manifest
from shards.io.http_range import ShardChanged
from shards.plan import partition as P
from shards.read.cache import ShardCache
from shards.read.reading import read_range
from trainer.data.placement import shared_manifest
from trainer.data.transforms import EvalTransform, TrainTransform, decode, multiscale_box

TRAIN, TEST = 23, 7
SMALL = dict(crop_size=32, scale_size=48, shuffle_buffer=6)


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("set"))
    make_shardset(d, {"train": TRAIN, "test": TEST}, per_shard=5)
    return d


def loader(where, **kw):
    args = dict(SMALL, batch_size=2, num_workers=0) | kw
    return clip_loader(where, args.pop("split", "train"), **args)


def keys_of(batches, valid_only=True):
    return [k for b in batches for k, ok in zip(b["keys"], b["valid"].tolist()) if ok or not valid_only]


def index_of(key):
    video, clip = key.split("_v")[1].split("_c")
    return int(video) * 2 + int(clip)


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 64])
def test_every_rank_equal_and_every_clip_once(shardset, world_size):
    batches = [list(loader(shardset, rank=r, world_size=world_size)) for r in range(world_size)]
    assert len({len(b) for b in batches}) == 1 and len(batches[0]) >= 1
    assert all(len(x["keys"]) == 2 for b in batches for x in b)
    valid = Counter(k for b in batches for k in keys_of(b))
    assert len(valid) == TRAIN and set(valid.values()) == {1}


def test_batches_hold_the_right_pixels_labels_and_videos(shardset):
    for b in loader(shardset, world_size=1, batch_size=3):
        assert b["clips"].dtype == torch.uint8 and b["clips"].shape == (3, 8, 3, 32, 32)
        assert b["clips"].flatten(0, 1).is_contiguous(memory_format=torch.channels_last)
        for clip, key, label, video in zip(b["clips"].numpy(), b["keys"], b["labels"].tolist(), b["videos"]):
            i = index_of(key)
            assert label == i % 3 and key.startswith(video + "_c")
            for t in range(8):
                assert np.abs(clip[t].reshape(3, -1).mean(1) - frame_colour(i, t)).max() < 4


def test_loader_follows_the_partition_plan_with_workers(shardset):
    """Two forked DataLoader workers: batches arrive in the planned round-robin order."""
    ld = loader(shardset, rank=1, world_size=2, num_workers=2, batch_size=2)
    got = keys_of(list(ld), valid_only=False)
    m = Manifest.load(shardset)
    sizes = [s.num_samples for s in m.splits["train"].shards]
    order = P.epoch_order(sizes, 0, 0)
    seq = P.rank_sequence(TRAIN, P.Segment(2, 2, 2), 1, "pad", 6, 0, 0)
    want = [m.splits["train"].shards[s].keys[i] for s, i in (order.locate(p) for p in seq)]
    assert got == want


def test_same_seed_same_order_and_new_order_per_seed_and_epoch(shardset):
    a = keys_of(list(loader(shardset, seed=1)))
    assert keys_of(list(loader(shardset, seed=1))) == a
    assert keys_of(list(loader(shardset, seed=2))) != a
    ld = loader(shardset, seed=1)
    assert len(ld) == 12 and keys_of(list(ld)) == a
    assert len(ld) == 12  # the next epoch's
    second = keys_of(list(ld))  # a finished epoch moves on to the next
    assert ld.epoch == 1 and second != a and sorted(second) == sorted(a)
    ld.set_epoch(0)
    assert keys_of(list(ld)) == a


def test_drop_remainder_gives_full_batches_only(shardset):
    with pytest.raises(ValueError, match="pad"):
        loader(shardset, world_size=8, batch_size=4, remainder="drop")
    lds = [loader(shardset, rank=r, world_size=3, batch_size=2, remainder="drop") for r in range(3)]
    keys = [keys_of(list(ld)) for ld in lds]
    assert [len(k) for k in keys] == [6, 6, 6] and len(set(sum(keys, []))) == 18


@pytest.mark.parametrize("workers,done", [(0, 3), (2, 3), (2, 4)])
def test_resume_mid_epoch_gives_the_identical_rest(shardset, workers, done):
    ld = loader(shardset, world_size=2, rank=1, num_workers=workers, batch_size=1)
    it = iter(ld)
    head = [next(it) for _ in range(done)]
    state = ld.state_dict()
    rest = list(it)
    assert state["samples_consumed"] == done and state["world_size"] == 2
    fresh = loader(shardset, world_size=2, rank=1, num_workers=workers, batch_size=1, seed=99)
    fresh.load_state_dict(state)
    fresh.set_epoch(0)  # a trainer's usual call keeps the resumed position
    assert len(fresh) == len(rest)
    assert keys_of(list(fresh), False) == keys_of(rest, False)
    assert len(head) + len(rest) == len(loader(shardset, world_size=2, batch_size=1))


def test_elastic_resume_from_4_ranks_to_3_covers_the_epoch_once(shardset):
    four = [loader(shardset, rank=r, world_size=4, num_workers=1) for r in range(4)]
    seen = Counter()
    for ld in four:
        it = iter(ld)
        for _ in range(2):
            seen.update(keys_of([next(it)]))
        it.close()
    state = four[0].state_dict()
    three = [loader(shardset, rank=r, world_size=3, num_workers=2) for r in range(3)]
    for ld in three:
        ld.load_state_dict(state)
    assert len({len(ld) for ld in three}) == 1
    for ld in three:
        seen.update(keys_of(list(ld)))
    assert len(seen) == TRAIN and set(seen.values()) == {1}


def test_reading_over_http_matches_disk(shardset):
    local = list(loader(shardset, world_size=2, rank=0, num_workers=2))
    with serve(shardset) as (url, requests):
        remote = list(loader(url, world_size=2, rank=0, num_workers=2))
        paths = [p for _, p in requests]
        assert paths[0] == "/manifest.json"
        assert (set(paths) - {"/manifest.json"} and all(p.endswith(".tar") for p in paths
                                                        if p != "/manifest.json"))
        assert all(method == "GET" for method, p in requests if p.endswith(".tar"))
    assert keys_of(remote, False) == keys_of(local, False)
    assert all((a["clips"] == b["clips"]).all() for a, b in zip(local, remote))


def test_shared_manifest_is_read_by_rank_zero_only(shardset):
    sent = []
    def broadcast(obj, root_rank):
        sent.append(obj)
        return obj if obj is not None else Manifest.load(shardset)
    assert shared_manifest("/nonexistent", 1, broadcast).classes == ["class0", "class1", "class2"]
    assert sent == [None]


def test_cache_stages_verified_shards_once(shardset, tmp_path):
    cache = str(tmp_path / "cache")
    with serve(shardset) as (url, requests):
        first = keys_of(list(loader(url, cache_dir=cache)))
        shard_requests = sum(p.endswith(".tar") for _, p in requests)
        second = keys_of(list(loader(url, cache_dir=cache)))
        assert sum(p.endswith(".tar") for _, p in requests) == shard_requests == 5
    assert first == second
    staged = sorted(os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs)
    assert len(staged) == 5 and not any(".tmp" in f for f in staged)


def test_cache_refuses_a_corrupt_copy(shardset, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(shardset, bad)
    m = Manifest.load(str(bad))
    shard = m.splits["train"].shards[0]
    path = bad / shard.name
    data = bytearray(path.read_bytes())
    data[700] ^= 1
    path.write_bytes(bytes(data))
    cache = ShardCache(str(tmp_path / "cache"))
    with pytest.raises(ShardChanged, match="the copy downloaded has SHA-256 [0-9a-f]{64}, the manifest says"):
        cache.fetch(m.shard_url(shard), shard.sha256, shard.bytes)
    assert not os.path.exists(cache.path(shard.sha256))


def test_byte_range_over_http_and_fsspec_memory(shardset):
    m = Manifest.load(shardset)
    shard = m.splits["train"].shards[1]
    disk = read_range(m.shard_url(shard), shard.offsets[2], shard.offsets[3])
    with serve(shardset) as (url, _):
        assert read_range(f"{url}/{shard.name}", shard.offsets[2], shard.offsets[3]) == disk
    import fsspec
    with fsspec.open(f"memory://h3/{shard.name}", "wb") as f:
        f.write(open(m.shard_url(shard), "rb").read())
    assert read_range(f"memory://h3/{shard.name}", shard.offsets[2], shard.offsets[3]) == disk


def test_eval_split_pads_with_invalid_unlabeled_clips(shardset):
    batches = list(loader(shardset, split="test", train=False, batch_size=4, eval_crops=3))
    assert [b["clips"].shape for b in batches] == [(4, 3, 8, 3, 48, 48)] * 2
    assert all((b["labels"] == -1).all() for b in batches)
    assert [b["valid"].tolist() for b in batches] == [[True] * 4, [True] * 3 + [False]]
    assert keys_of(batches) == sorted(keys_of(batches), key=index_of)


# --- transforms ---------------------------------------------------------------------------
def gradient_jpeg(w, h):
    a = np.tile(np.linspace(0, 255, w, dtype=np.uint8)[None, :, None], (h, 1, 3))
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def test_draft_decoding_shrinks_big_frames_but_not_below_the_short_side():
    assert decode(gradient_jpeg(1024, 768), 256).size == (512, 384)
    assert decode(gradient_jpeg(340, 256), 256).size == (340, 256)


def test_multiscale_crop_sizes_and_positions():
    rng = random.Random(0)
    seen = set()
    for _ in range(300):
        x0, y0, x1, y1 = multiscale_box(340, 256, 224, rng)
        assert 0 <= x0 and x1 <= 340 and 0 <= y0 and y1 <= 256
        w, h = x1 - x0, y1 - y0
        allowed = [256, 224, 192, 168]  # 256 x (1, .875 -> 224, .75, .66)
        assert w in allowed and h in allowed and abs(allowed.index(w) - allowed.index(h)) <= 1
        seen.add((w, h))
    assert len(seen) == 10


@pytest.mark.parametrize("flip", [True, False])
def test_train_transform_same_crop_for_all_frames_and_flip_switch(flip):
    jpegs = [gradient_jpeg(340, 256)] * 4
    t = TrainTransform(224, 256, flip=flip)
    flipped = 0
    for seed in range(20):
        clip = t(jpegs, random.Random(seed))
        assert clip.shape == (4, 224, 224, 3) and clip.dtype == np.uint8
        assert all((clip[i] == clip[0]).all() for i in range(4))
        flipped += int(clip[0, 0, 0, 0]) > int(clip[0, 0, -1, 0])
    assert (flipped > 0) == flip


def test_eval_transform_centre_and_three_crops():
    jpegs = [gradient_jpeg(340, 256)] * 2
    centre = EvalTransform(224, 256)(jpegs)
    assert centre.shape == (2, 224, 224, 3)
    assert abs(int(centre[0, 0, 112, 0]) - 128) < 4  # centre of the gradient stays in the centre
    three = EvalTransform(224, 256, crops=3)(jpegs)
    assert three.shape == (3, 2, 256, 256, 3)
    left, right, mid = (int(v[0, 0, 0, 0]) for v in three)
    assert left < mid < right
