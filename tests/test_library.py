"""docs/library.md runs as written: every Python block of the page is executed here, with only the set's
location substituted (the table in ``SUBSTITUTE``), and what it prints is checked against the set: every
clip once per epoch, on every rank, and a resumed run continuing the identical sequence.

Also the reading API's own contracts that the page states: ``ClipDataset`` yields what ``ClipLoader``
yields (same clips, same pixels, same order), rank and world size from the environment, the upsampling
warning, ``normalise``'s constants, the import staying free of the heavy packages; and the arguments: each
wrong one refused as the loader is made, in one line naming it, splits other than ``train`` read for
evaluation, a DataLoader batching otherwise warned about once, warnings at the caller's line.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.shardsets import ServiceProcess, clip_loader, make_shardset, register

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "library.md"
TRAIN = 24
# what the page's blocks name -> the test's stand-ins (written out in full, as tests/helpers/runbooks.py does)
LOCAL, SERVED, CACHE = ("/data/kinetics400/shards", "http://127.0.0.1:8470/v1/datasets/kinetics400",
                        "/tmp/kinetics-cache")
# each Python block of the page is recognised by one line of it, and run by the test named beside it
BLOCKS = {"max_steps = int(os.environ": "test_own_loop_resumes_the_identical_sequence",
          "dist.init_process_group(\"gloo\")": "test_torchrun_ranks_read_every_clip_once",
          "train = ClipDataset(data, \"train\", batch_size=8": "test_dataset_in_a_dataloader_of_ones_own",
          "def centre_square(": "test_own_transform_and_raw_jpegs",
          "first = loader()": "test_stateful_dataloader_resumes",
          "class Clips(L.LightningDataModule)": "test_lightning_datamodule",
          "cache_dir=\"/tmp/kinetics-cache\"": "test_node_cache_through_the_service"}


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), flags=re.S | re.M)


def block(marker: str) -> str:
    (found,) = [b for b in python_blocks() if marker in b]
    return found


def run_block(marker: str, data: str, cwd: Path, env: dict | None = None, command=(sys.executable,),
              cache: str | None = None, timeout: int = 300) -> list[str]:
    """The block as written, the set's location (and the cache directory) substituted; its output lines."""
    code = block(marker).replace(LOCAL, data).replace(SERVED, data)
    if cache:
        code = code.replace(CACHE, cache)
    script = cwd / "example.py"
    script.write_text(code)
    run = subprocess.run([*command, str(script)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "Traceback" not in run.stderr, run.stderr[-5000:]
    return run.stdout.splitlines()


def keys(lines: list[str], prefix: str = "") -> list[tuple[str, list[str]]]:
    """(the epoch, the batch's keys) of each printed batch line that starts with ``prefix``."""
    out = []
    for line in lines:
        if line.startswith(prefix):
            fields = line[len(prefix):].split()
            out.append((fields[0].rstrip(":"), [f for f in fields[1:] if f.startswith("train_")]))
    return out


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    d = tmp_path_factory.mktemp("set")
    make_shardset(str(d), {"train": TRAIN, "val": 6}, per_shard=5)
    return str(d)


def train_keys(shardset) -> set[str]:
    from shards.format.manifest import Manifest
    return {k for s in Manifest.load(shardset).splits["train"].shards for k in s.keys}


def every_clip_once(batches: list[tuple[str, list[str]]], shardset, epochs=("0", "1")) -> None:
    for epoch in epochs:
        seen = Counter(k for e, ks in batches if e == epoch for k in ks)
        assert set(seen) == train_keys(shardset), epoch


def test_every_python_block_of_the_page_is_run_here():
    blocks = python_blocks()
    assert len(blocks) == len(BLOCKS)
    for b in blocks:
        assert sum(marker in b for marker in BLOCKS) == 1, b[:300]
    assert all(name in globals() for name in BLOCKS.values())


# long: four runs of the page's training loop, 30 s on 2 cores; the suite keeps the StatefulDataLoader
# block and tests/test_epochs.py's resume at every stop point
@pytest.mark.long
def test_own_loop_resumes_the_identical_sequence(shardset, tmp_path):
    (tmp_path / "whole").mkdir()
    (tmp_path / "cut").mkdir()
    whole = keys(run_block("max_steps = int(os.environ", shardset, tmp_path / "whole"))
    assert len(whole) == 2 * TRAIN // 8
    every_clip_once(whole, shardset)
    # stopped at the end of epoch 0, then inside epoch 1: each run goes on with the identical batches
    runs = [keys(run_block("max_steps = int(os.environ", shardset, tmp_path / "cut", env=env))
            for env in ({"MAX_STEPS": "3"}, {"MAX_STEPS": "1"}, {})]
    assert [len(r) for r in runs] == [3, 1, 2] and sum(runs, []) == whole


@pytest.mark.long
def test_torchrun_ranks_read_every_clip_once(shardset, tmp_path):
    # each rank's stdout to a file of its own: on one shared pipe the ranks' prints interleave (a
    # print reaches it in a write per argument), merging lines of both ranks
    logs = tmp_path / "logs"
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--redirects", "1", "--log-dir", str(logs))
    run_block("dist.init_process_group(\"gloo\")", shardset, tmp_path, command=torchrun,
              env={"OMP_NUM_THREADS": "1"})
    lines = [line for path in sorted(logs.rglob("stdout.log")) for line in path.read_text().splitlines()]
    by_rank = {r: [(e, ks) for line in lines if line.startswith(f"rank {r} ")
                   for e, ks in keys([line.removeprefix(f"rank {r} epoch ")])] for r in (0, 1)}
    # equal batches: 24 clips / (2 ranks x 8) -> 2 an epoch
    assert len(by_rank[0]) == len(by_rank[1]) == 2 * 2
    for epoch in ("0", "1"):
        seen = Counter(k for r in (0, 1) for e, ks in by_rank[r] if e == epoch for k in ks)
        assert set(seen) == train_keys(shardset) and sum(seen.values()) == 32  # 8 padding repeats


def test_dataset_in_a_dataloader_of_ones_own(shardset, tmp_path):
    lines = run_block("train = ClipDataset(data, \"train\", batch_size=8", shardset, tmp_path)
    assert all("(8, 8, 3, 112, 112)" in line for line in lines) and len(lines) == 2 * TRAIN // 8
    batches = [(e, ks) for e, ks in keys([re.sub(r"\(.*?\) ", "", line) for line in lines])]
    every_clip_once(batches, shardset)
    assert [ks for e, ks in batches if e == "0"] != [ks for e, ks in batches if e == "1"]  # a new order


def test_own_transform_and_raw_jpegs(shardset, tmp_path):
    lines = run_block("def centre_square(", shardset, tmp_path)
    assert lines == ["torch.Size([4, 8, 3, 48, 48])", "4 clips of 8 JPEGs; crop boxes torch.Size([4, 1, 4])"]


def test_stateful_dataloader_resumes(shardset, tmp_path):
    assert run_block("first = loader()", shardset, tmp_path)[-1].startswith("resumed:")


@pytest.mark.long
def test_lightning_datamodule(shardset, tmp_path):
    lines = run_block("class Clips(L.LightningDataModule)", shardset, tmp_path, env={"OMP_NUM_THREADS": "1"})
    batches = keys([line.removeprefix("step ") for line in lines if line.startswith("step ")])
    assert len(batches) == 2 * TRAIN // 8
    every_clip_once(batches, shardset)  # the epoch moved on by itself: Lightning calls no set_epoch on it


@pytest.fixture(scope="module")
def served(shardset, tmp_path_factory):
    from shards.catalog import Catalog

    catalog = Catalog(str(tmp_path_factory.mktemp("catalog") / "catalog.sqlite"))
    register(catalog, shardset, "kinetics400")
    server = ServiceProcess("--catalog", catalog.path)
    server.start()
    yield f"{server.url}/v1/datasets/kinetics400"
    server.kill(15)


def test_node_cache_through_the_service(shardset, served, tmp_path):
    cache = tmp_path / "cache"
    lines = run_block("cache_dir=\"/tmp/kinetics-cache\"", served, tmp_path, cache=str(cache))
    assert lines[1:] == [f"0 {TRAIN} clips", f"1 {TRAIN} clips"], lines
    copies = [p for p in cache.rglob("*") if p.is_file() and p.name.endswith(".tar")]
    assert len(copies) == 5  # every shard downloaded once, read from the node's disk both epochs


# --- the API's own contracts ---------------------------------------------------------------------
def test_dataset_yields_what_the_ready_loader_yields(shardset):
    from torch.utils.data import DataLoader

    from trainer.data import ClipDataset, ClipLoader, EpochOptions

    ready = list(ClipLoader(shardset, "train", EpochOptions(batch_size=4, seed=3), num_workers=2,
                            crop_size=32, scale_size=40))
    dataset = ClipDataset(shardset, "train", batch_size=4, seed=3, crop_size=32, scale_size=40)
    mine = list(DataLoader(dataset, batch_size=4, num_workers=2))
    assert [b["keys"] for b in mine] == [b["keys"] for b in ready]
    for a, b in zip(mine, ready):
        assert torch.equal(a["clips"], b["clips"]) and torch.equal(a["valid"], b["valid"])
        assert torch.equal(a["labels"], b["labels"])


def test_rank_and_world_size_from_the_environment(shardset, monkeypatch):
    from trainer.data import ClipDataset, ClipLoader, EpochOptions

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    loader = ClipLoader(shardset, "train", EpochOptions(batch_size=4), num_workers=0)
    assert (loader.rank, loader.world_size, loader.local_size) == (1, 2, 2)
    halves = [{k for b in ClipLoader(shardset, "train", EpochOptions(batch_size=4, rank=r, world_size=2),
                                     num_workers=0) for k in b["keys"]} for r in (0, 1)]
    assert {k for b in loader for k in b["keys"]} == halves[1] != halves[0]
    assert len(ClipDataset(shardset, "train", batch_size=4)) == TRAIN // 2


def test_crops_larger_than_the_stored_frames_warn(tmp_path):
    from shards.format.manifest import Manifest
    from trainer.data import ClipLoader, EpochOptions, Upsampling

    m = make_shardset(str(tmp_path), {"train": 8}, per_shard=4)
    m.config["clip"]["short_side"] = 48
    m.save(str(tmp_path))
    with pytest.warns(Upsampling, match="48 pixels on their short side.*scale_size=48, crop_size=42"):
        ClipLoader(str(tmp_path), "train", EpochOptions(batch_size=4), crop_size=224, scale_size=256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ClipLoader(Manifest.load(str(tmp_path)), "train", EpochOptions(batch_size=4), crop_size=48,
                   scale_size=56)


def test_normalise_is_imagenets_and_the_models():
    from trainer.data import MEAN, STD, normalise
    from trainer.model.tsm import NORMALISE

    clips = torch.full((1, 2, 3, 4, 4), 255, dtype=torch.uint8)
    clips[:, :, 1] = 0
    out = normalise(clips)
    assert torch.allclose(out[0, 0, :, 0, 0], torch.tensor([(1 - MEAN[0]) / STD[0], -MEAN[1] / STD[1],
                                                            (1 - MEAN[2]) / STD[2]]))
    assert NORMALISE["rgb"][:2] == (MEAN, STD)


def test_the_reading_api_imports_none_of_the_heavy_packages():
    heavy = ("ray", "aiohttp", "cv2", "horovod", "matplotlib", "tensorboard", "av", "ffmpeg", "lightning")
    code = ("import sys, trainer.data as d; d.ClipLoader, d.ClipDataset, d.normalise; "
            "import shards.read.direct, shards.read.reading; print(sorted(m for m in sys.modules if "
            f"m.split('.')[0] in {heavy!r} and m.split('.')[0] != 'cv2'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


# --- the loader's parts: the plan and the position are plain data and pure functions -----------------
def test_a_position_continues_the_same_layout_and_splits_the_rest_of_the_epoch_for_another():
    from shards.plan.partition import Segment
    from trainer.data.position import Position, Shuffle

    here = Segment(world_size=2, num_workers=2, batch_size=4, nodes=1)
    saved = Position(epoch=3, done=5).state_dict(here, Shuffle(seed=7, shuffle_buffer=16))
    assert (saved["samples_consumed"] == 20
            and Position.shuffle_of(saved) == Shuffle(seed=7, shuffle_buffer=16))
    same = Position.resume(saved, here)
    assert (same.epoch, same.past, same.done) == (3, [], 5)
    other = Position.resume(saved, Segment(world_size=4, num_workers=2, batch_size=4, nodes=1))
    assert (other.epoch, other.past, other.done) == (3, [Segment(2, 2, 4, 5, 1)], 0)


def test_a_worker_plan_reads_whole_ranges_once(shardset):
    from shards.format.manifest import Manifest
    from shards.plan import partition
    from trainer.data.plan import worker_plan

    shards = Manifest.load(shardset).splits["train"].shards
    (order,) = partition.epoch_orders([s.num_samples for s in shards], 1, 0, 0, True, None)
    (stream,) = partition.streams([len(order)], 1, 0, 1, 4)
    emitted = partition.emission(stream, 8, 0, 0)
    plan = worker_plan(shards, [f"u{i}" for i in range(len(shards))], order, stream, emitted, 1, 4)
    assert plan.order == tuple(emitted[4:])  # the first batch (4 clips) made already: left out
    key_at = [shards[r.shard].keys[j] for r in order.slice(0, len(order)) for j in range(r.start, r.stop)]
    assert sorted((k, i) for k, i in plan.expected
                  if i is not None) == sorted((key_at[i], i) for i in plan.order)
    for read in plan.reads:  # each read lies in its shard; the reads hold the expected keys in file order
        assert 0 <= read.start < read.end <= read.info.bytes and read.url == f"u{read.shard}"
    assert [k for k, _ in plan.expected] == [s.keys[j] for r in plan.reads for s in [r.info]
                                             for j in range(len(s.keys)) if r.start <= s.offsets[j] < r.end]


# --- what a user's own decoding gets: the crop's geometry, and seeded draws of a transform --------------
def textured(colour, size=(64, 48)) -> bytes:
    """A test frame with a gradient across it (red rising to the right, green downwards), so that every
    crop box and its mirror image are told apart by their pixels; blue from the clip's colour."""
    import io

    import numpy as np
    from PIL import Image

    w, h = size
    x, y = np.meshgrid(np.arange(w), np.arange(h))
    pixels = np.dstack([x * 255 // (w - 1), y * 255 // (h - 1), np.full((h, w), colour[0])]).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=95)
    return buf.getvalue()


@pytest.fixture(scope="module")
def textured_set(tmp_path_factory):
    from helpers import shardsets

    d = tmp_path_factory.mktemp("textured")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shardsets, "jpeg", textured)
        make_shardset(str(d), {"train": 8}, per_shard=4, frames=2, size=(96, 72))
    return str(d)


def test_the_geometry_given_is_the_crop_the_built_in_transform_takes(textured_set):
    """``geometry=True``: cropping the stored frame at ``boxes`` (and mirroring when ``flip``) gives the
    pixels of ``frames="crops"``, for frames the crop decoder reads at half size (``dct_denom``)."""
    import io

    import numpy as np
    from PIL import Image

    from trainer.data import ClipDataset

    options = dict(batch_size=4, crop_size=24, scale_size=32, seed=5)
    crops = {k: c for s in ClipDataset(textured_set, **options) for k, c in [(s["keys"], s["clips"])]}
    flips = []
    for s in ClipDataset(textured_set, frames="jpeg", geometry=True, **options):
        whole = Image.open(io.BytesIO(s["clips"][0])).convert("RGB")
        made = crops[s["keys"]][0].movedim(0, -1).numpy().astype(float)  # frame 0, (H, W, C)
        (box,) = s["boxes"].tolist()
        mine = np.asarray(whole.resize((24, 24), Image.BILINEAR, box=box), dtype=float)
        right, mirrored = (mine[:, ::-1], mine) if s["flip"] else (mine, mine[:, ::-1])
        assert np.abs(made - right).mean() < 4 < np.abs(made - mirrored).mean(), (s["keys"], box, s["flip"])
        flips.append(s["flip"])
    assert len(flips) == 8 and any(flips) and not all(flips)


def test_a_users_transform_draws_the_same_whatever_the_workers(shardset):
    """``frames="decoded"`` with a random transform: each clip gets the same draws with one DataLoader
    worker or two (torch's RNG seeded by the clip's key, the seed and the epoch), and other draws in
    another epoch."""
    from torch.utils.data import DataLoader

    from trainer.data import ClipDataset

    def shift(clip: torch.Tensor) -> torch.Tensor:
        return clip.roll(int(torch.randint(0, 64, ())),
                         dims=-1)[..., :8] + torch.randint(0, 9, (1,), dtype=torch.uint8)

    def by_key(workers: int, epoch: int) -> dict:
        dataset = ClipDataset(shardset, "train", batch_size=4, frames="decoded", transform=shift, seed=1)
        dataset.set_epoch(epoch)
        return {k: c for b in DataLoader(dataset, batch_size=4, num_workers=workers)
                for k, c in zip(b["keys"], b["clips"])}

    one, two = by_key(1, 0), by_key(2, 0)
    assert set(one) == set(two) == train_keys(shardset)
    assert all(torch.equal(one[k], two[k]) for k in one)
    later = by_key(1, 1)
    assert sum(not torch.equal(one[k], later[k]) for k in one) > len(one) // 2


# --- the arguments: each wrong one refused when the loader is made, in one line naming it ----------------
REFUSED = [  # (the arguments, the error, words its message must hold)
    ({"split": "validation"}, ValueError, ["split='validation'", "'train', 'val'"]),
    ({"batch_size": 0}, ValueError, ["batch_size: 0 is out of range: give 1 or more"]),
    ({"batch_size": -2}, ValueError, ["batch_size: -2 is out of range"]),
    ({"batch_size": 4.0}, TypeError, ["batch_size", "an int", "float"]),
    ({"batch_size": "4"}, TypeError, ["batch_size", "an int", "str"]),
    ({"crop_size": 0}, ValueError, ["crop_size: 0 is out of range: give 1 or more"]),
    ({"train": False, "crop_size": 128, "scale_size": 64}, ValueError,
     ["scale_size=64", "crop_size=128", "scale_size 128 or more"]),
    ({"split": "val", "crop_size": 128, "scale_size": 64}, ValueError, ["scale_size=64", "crop_size=128"]),
    ({"scale_size": -1}, ValueError, ["scale_size: -1 is out of range"]),
    ({"world_size": 0}, ValueError, ["world_size: 0 is out of range: give 1 or more"]),
    ({"rank": 2, "world_size": 2}, ValueError, ["rank: 2 is out of range: give 0 to 1"]),
    ({"rank": -1, "world_size": 2}, ValueError, ["rank: -1 is out of range"]),
    ({"local_size": 0}, ValueError, ["local_size: 0 is out of range"]),
    ({"epoch": -1}, ValueError, ["epoch: -1 is out of range: give 0 or more"]),
    ({"seed": 1.5}, TypeError, ["seed", "an int"]),
    ({"shuffle_buffer": -1}, ValueError, ["shuffle_buffer: -1 is out of range: give 0 or more"]),
    ({"lookahead": -1}, ValueError, ["lookahead: -1 is out of range"]),
    ({"piece_samples": 0}, ValueError, ["piece_samples: 0 is out of range: give 1 or more"]),
    ({"source_deadline": -1.0}, ValueError, ["source_deadline: -1.0 is out of range"]),
    ({"eval_crops": 2}, ValueError, ["eval_crops=2", "1, 3"]),
    ({"remainder": "keep"}, ValueError, ["remainder='keep'", "'pad', 'drop'"]),
    ({"shuffle": "nodes"}, ValueError, ["shuffle='nodes'", "'global', 'node'"]),
    ({"modality": "flow"}, ValueError, ["modality='flow'", "'rgb', 'motion'"]),
    ({"direct_reads": "sometimes"}, ValueError, ["direct_reads='sometimes'", "'auto', 'never', 'always'"]),
    ({"flip": "no"}, TypeError, ["flip", "True or False", "str"]),
    ({"train": "val"}, TypeError, ["train", "True, False or None"]),
]
ONLY_LOADER = [({"num_workers": -1}, ValueError, ["num_workers: -1 is out of range: give 0 or more"]),
               ({"max_bad_samples": -1}, ValueError, ["max_bad_samples: -1 is out of range"]),
               ({"cache_dir": "cache", "cache_budget": "64XB"}, ValueError,
                ["cache_budget='64XB'", "a size"])]
ONLY_DATASET = [({"frames": "png"}, ValueError, ["frames='png'", "'crops', 'decoded', 'jpeg'"]),
                ({"transform": 5}, TypeError, ["transform", "a callable or None", "int"]),
                ({"frames": "decoded", "geometry": "yes"}, TypeError, ["geometry", "True or False"]),
                ({"skip_bad": 1}, TypeError, ["skip_bad", "True or False", "int"])]
LOADER_CASES = [("ClipLoader", *case) for case in REFUSED + ONLY_LOADER]
DATASET_CASES = [("ClipDataset", *case) for case in REFUSED + ONLY_DATASET]


@pytest.mark.parametrize("api, arguments, error, words", LOADER_CASES + DATASET_CASES,
                         ids=[f"{c[0]}-{','.join(f'{k}={v}' for k, v in c[1].items())}"
                              for c in LOADER_CASES + DATASET_CASES])
def test_a_wrong_argument_is_refused_when_the_loader_is_made_naming_it(shardset, api, arguments, error,
                                                                        words):
    import trainer.data

    arguments = {"split": "train", "batch_size": 4, "crop_size": 32, "scale_size": 40} | arguments
    with pytest.raises(error) as refused:
        (clip_loader if api == "ClipLoader" else trainer.data.ClipDataset)(shardset, arguments.pop("split"),
                                                                           **arguments)
    message = str(refused.value)
    assert type(refused.value) is error and "\n" not in message  # no ZeroDivisionError, no bare KeyError
    assert all(w in message for w in words), message


def test_the_loader_takes_the_planners_options_as_one_object_only(shardset):
    from trainer.data import ClipLoader, EpochOptions

    with pytest.raises(TypeError, match="unexpected keyword argument 'seed'"):
        ClipLoader(shardset, "train", EpochOptions(batch_size=4), seed=3)
    with pytest.raises(TypeError,
                       match=r"^epochs must be a trainer.data.EpochOptions, not dict \{'batch_size': 4\}$"):
        ClipLoader(shardset, "train", {"batch_size": 4})
    assert ClipLoader(shardset, "train", EpochOptions(batch_size=4, seed=3)).seed == 3


def test_every_numeric_argument_of_the_loader_is_bounded(shardset):
    """Every int or float option of ``ClipLoader`` (its own and the planner's, ``EpochOptions``; but the
    seed, any int) refuses -1 naming itself and its range (or its few choices)."""
    import dataclasses
    import inspect

    from trainer.data import ClipLoader
    from trainer.data.epochs import EpochOptions

    options = [(p.name, p.annotation) for p in inspect.signature(ClipLoader).parameters.values()]
    options += [(f.name, f.type) for f in dataclasses.fields(EpochOptions)]
    numeric = [name for name, annotation in options
               if name != "seed" and {"int", "float"} & set(re.findall(r"\w+", str(annotation)))]
    assert len(numeric) >= 12, numeric
    for name in numeric:
        arguments = {"batch_size": 4, "crop_size": 32, "scale_size": 40, name: -1}
        with pytest.raises(ValueError, match=rf"^{name}(: -1 is out of range: give|=-1: give one of)"):
            clip_loader(shardset, "train", **arguments)


def test_a_split_other_than_train_reads_with_the_evaluation_transform_unless_asked(shardset):
    """``train`` left out: True for the split named "train" (random crops, flips, a shuffled order), False
    for the others (the centre crop, in stored order); ``train=True`` still augments any split."""
    from shards.format.manifest import Manifest
    from trainer.data import ClipDataset, ClipLoader, EpochOptions, EvalTransform, TrainTransform

    stored = [k for s in Manifest.load(shardset).splits["val"].shards for k in s.keys]
    options = {"crop_size": 32, "scale_size": 40, "num_workers": 0}
    val = ClipLoader(shardset, "val", EpochOptions(batch_size=2), **options)
    assert not val.train and type(val.transform) is EvalTransform
    for epoch in (0, 1):
        val.set_epoch(epoch)
        assert [k for b in val for k in b["keys"]] == stored
    assert [s["keys"] for s in ClipDataset(shardset, "val", batch_size=2, crop_size=32,
                                           scale_size=40)] == stored
    assert type(ClipLoader(shardset, "val", EpochOptions(batch_size=2, train=True), **options).transform) \
        is TrainTransform
    assert type(ClipLoader(shardset, "train", EpochOptions(batch_size=2),
                           **options).transform) is TrainTransform


# --- warnings: once, at the caller's line ------------------------------------------------------------------
def test_the_upsampling_warning_points_at_the_callers_line(tmp_path):
    from trainer.data import ClipDataset, ClipLoader, EpochOptions, Upsampling

    m = make_shardset(str(tmp_path), {"train": 8}, per_shard=4)
    m.config["clip"]["short_side"] = 48
    m.save(str(tmp_path))
    for api, make in (("ClipLoader", lambda: ClipLoader(str(tmp_path), "train", EpochOptions(batch_size=4),
                                                        crop_size=224, scale_size=256)),
                      ("ClipDataset", lambda: ClipDataset(str(tmp_path), "train", batch_size=4, crop_size=224,
                                                          scale_size=256))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        (w,) = [w for w in caught if w.category is Upsampling]
        assert w.filename == __file__, (api, w.filename)


def test_a_dataloader_batching_other_than_the_dataset_warns_once_at_the_callers_line(shardset):
    from torch.utils.data import DataLoader

    from trainer.data import BatchSizeMismatch, ClipDataset

    dataset = ClipDataset(shardset, "train", batch_size=4, crop_size=32, scale_size=40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sizes = [len(b["keys"]) for _ in range(2) for b in DataLoader(dataset, batch_size=8)]
        list(DataLoader(dataset, batch_size=4))  # the planned batches, and unbatched samples: no warning
        list(DataLoader(dataset, batch_size=None))
    assert sizes == [8, 8, 8] * 2  # 24 clips: here the batches happen to be whole
    (w,) = [w for w in caught if w.category is BatchSizeMismatch]
    assert (w.filename == __file__
            and "DataLoader(batch_size=8) over ClipDataset(batch_size=4)" in str(w.message))


def test_a_dataloader_batching_otherwise_warns_once_from_its_workers(shardset, tmp_path):
    """With workers, the first one warns on its stderr, once over two epochs; the batches are ragged."""
    script = tmp_path / "ragged.py"
    script.write_text("from torch.utils.data import DataLoader\nfrom trainer.data import ClipDataset\n"
                      f"dataset = ClipDataset({shardset!r}, 'train', batch_size=4, crop_size=32, "
                      "scale_size=40)\nfor epoch in range(2):\n"
                      "    print(*(len(b['keys']) for b in DataLoader(dataset, batch_size=8, "
                      "num_workers=2)))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         check=False, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    # each worker's 12 clips: 8, then the 4 left (the issue's)
    assert run.stdout.splitlines() == ["8 8 4 4"] * 2
    assert run.stderr.count("BatchSizeMismatch: DataLoader(batch_size=8) over ClipDataset(batch_size=4)") == 1
