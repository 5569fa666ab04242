"""Bad samples have a policy (issue 26; docs/faults.md): a sample whose bytes differ from the
manifest's digest stops the run in one line by default, or, under ``--max-bad-samples`` (the
loader's ``max_bad_samples``), is left out on every rank alike up to a budget per epoch.

The sets are written by ``shardsets.make_shardset`` and damaged as bit rot would damage them: 40
bytes flipped inside a JPEG of one sample, the shard's size and modification time kept (so the
dataset service cannot tell either). The two-rank runs are real ``horovodrun -np 2 --gloo`` jobs on
127.0.0.1, their clips counted from the trainer's own ``--clip-log``: from the set's directory, over
``shard-service serve`` in byte ranges and through a node cache (``--cache-dir``, where the damaged
shards' copies are kept aside), and from a copy of the set ``shard-service verify`` marked damaged,
read with ``Prefer: handling=lenient``.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers.shardsets import ServiceProcess, corrupt_sample, make_shardset, register

from shards.base.errors import DataFault
from shards.catalog import Catalog
from shards.format.digests import CorruptSample, TooManyBadSamples
from shards.format.manifest import Manifest
from trainer import metrics
from trainer.clip_log import read_file
from trainer.data import ClipLoader, EpochOptions

HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
FAULTRUN = str(Path(__file__).with_name("helpers") / "faultrun.py")
CLIPS, VAL, BATCH = 20, 6, 2
FLAGS = ["--segments", "4", "--depth", "10", "--width", "8", "--crop-size", "32", "--scale-size", "36",
         "--batch-size", str(BATCH), "--warmup-epochs", "0.5", "--workers", "1", "--print-freq", "1",
         "--no-tensorboard", "--clip-log"]


def damage(directory, split: str, shard: int, sample: int) -> tuple[str, str]:
    """40 bytes flipped inside the first JPEG of a sample, size and mtime kept: (its key, its shard)."""
    info = corrupt_sample(directory, split, shard, sample, at=600, nbytes=40, mask=0xFF)
    return info.keys[sample], info.name


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """``one``: a training sample and a validation sample damaged; ``two``: two training samples;
    ``marked``: a copy of ``one`` (to be marked damaged by ``shard-service verify``)."""
    root = tmp_path_factory.mktemp("bad")
    out = {"root": root}
    for name in ("one", "two"):
        make_shardset(str(root / name), {"train": CLIPS, "val": VAL}, per_shard=5, frames=4, size=(48, 40))
    out["one"] = {"train": damage(root / "one", "train", 1, 2), "val": damage(root / "one", "val", 0, 1)}
    out["two"] = {"train": [damage(root / "two", "train", 0, 1), damage(root / "two", "train", 3, 4)]}
    shutil.copytree(root / "one", root / "marked")
    return out


def keys_of(directory, split: str) -> list[str]:
    return [k for s in Manifest.load(str(directory)).splits[split].shards for k in s.keys]


# --- the loader ----------------------------------------------------------------------------------
def test_the_loader_leaves_a_bad_sample_out_with_equal_batches_on_every_rank(sets):
    """Two ranks' loaders (2 workers each, so the records cross a process boundary), two epochs."""
    directory = sets["root"] / "one"
    bad_key, bad_shard = sets["one"]["train"]
    good = set(keys_of(directory, "train")) - {bad_key}
    info = next(s for s in Manifest.load(str(directory)).splits["train"].shards if s.name == bad_shard)
    loaders = [ClipLoader(str(directory), "train", EpochOptions(batch_size=BATCH, rank=r, world_size=2),
                          num_workers=2, crop_size=32, scale_size=36, max_bad_samples=None) for r in (0, 1)]
    for epoch in (0, 1):
        trained, found, sizes = Counter(), [], []
        for loader in loaders:
            loader.set_epoch(epoch)
            batches = list(loader)
            sizes.append([len(b["keys"]) for b in batches])
            for b in batches:
                trained.update(k for k, v in zip(b["keys"], b["valid"].tolist()) if v)
                found += [(r, b["keys"][r["slot"]], b["valid"][r["slot"]].item()) for r in b["bad"]]
        assert sizes[0] == sizes[1] == [BATCH] * (CLIPS // (2 * BATCH))  # the same batches on both ranks
        assert trained == Counter(good)  # every good clip once, the bad one never
        ((record, stand_in, valid),) = found  # listed once, by the rank that met it; its slot holds a repeat
        assert stand_in != bad_key and stand_in in good and valid is False
        assert {k: record[k] for k in ("shard", "key", "index", "clip", "split", "expected", "url")} == {
            "shard": bad_shard, "key": bad_key, "index": 2, "clip": 7, "split": "train",
            "expected": info.digests[2],
            "url": os.path.join(str(directory), bad_shard)}
        assert record["found"] != record["expected"] and record["rank"] in (0, 1)


def test_the_loader_stops_at_the_first_bad_sample_by_default_and_past_its_budget(sets):
    directory = sets["root"] / "two"
    with pytest.raises(CorruptSample) as stop:  # raised in a worker, received by the rank (pickled)
        list(ClipLoader(str(directory), "train", EpochOptions(batch_size=BATCH), num_workers=1, crop_size=32,
                        scale_size=36))
    e = stop.value
    assert isinstance(e, DataFault) and (e.key, e.shard) in sets["two"]["train"] and e.found != e.expected
    assert str(e) == (f"{e.url}: shard {e.shard}, sample {e.key}: xxh3-64 digest {e.found}, the manifest "
                      f"says {e.expected} (read twice)")
    assert pickle.loads(pickle.dumps(e)).facts() == e.facts()
    loader = ClipLoader(str(directory), "train", EpochOptions(batch_size=BATCH), num_workers=1, crop_size=32,
                        scale_size=36, max_bad_samples=1)
    done = []
    with pytest.raises(TooManyBadSamples, match=r"^2 bad samples in epoch 1 of train on rank 0, more than "
                                                r"max_bad_samples=1; the last: .* \(read twice\)$"):
        for batch in loader:
            done.append(batch["keys"])
    # the batch that went over is not counted as read: a resume would read it again
    assert loader.state_dict()["samples_consumed"] == len(done) * BATCH < CLIPS


# --- two ranks under horovodrun ------------------------------------------------------------------
def train(data: str, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, FAULTRUN,
                           "train", "--data", data, "--output-dir", str(out), *FLAGS, *extra],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "EXIT_LOG": str(out / "exits"),
                               **(env or {})},
                          capture_output=True, text=True, timeout=600, start_new_session=True)


def rank_lines(run: subprocess.CompletedProcess, rank: int) -> list[str]:
    """What one rank printed (horovodrun prefixes its lines with ``[rank]<stream>:``)."""
    return [line.split(":", 1)[1] for line in (run.stdout + run.stderr).splitlines()
            if line.startswith(f"[{rank}]<")]


def exits(out: Path) -> dict[int, list[int]]:
    return {r: [json.loads(line)["exit"] for line in (out / f"exits.rank{r}.jsonl").read_text().splitlines()]
            for r in (0, 1)}


@pytest.fixture(scope="module")
def served(sets):
    """The damaged sets registered in a catalog and served by ``shard-service serve``; ``marked``
    verified first, so the service holds it damaged."""
    catalog = Catalog(str(sets["root"] / "catalog.sqlite"))
    for name in ("one", "two", "marked"):
        register(catalog, str(sets["root"] / name), name)
    verified = subprocess.run([sys.executable, "-m", "service", "verify", "--catalog", catalog.path,
                               "marked"], capture_output=True, text=True, timeout=300)
    assert verified.returncode == 1 and catalog.resolve("marked").verify_problems, verified.stderr
    server = ServiceProcess("--catalog", catalog.path)
    server.start()
    yield server.url
    server.kill(15)


LENIENT = {"FSSPEC_HTTP_HEADERS": json.dumps({"Prefer": "handling=lenient"})}  # docs/service.md


@pytest.mark.long
@pytest.mark.parametrize("source, cached", [("local", False), ("http", False), ("http", True),
                                            ("marked", False), ("marked", True)])
def test_two_ranks_go_on_without_a_bad_sample_every_good_clip_once_an_epoch(sets, served, source, cached,
                                                                             tmp_path):
    """Through the node cache the damaged shards' copies are kept aside and read sample by sample
    (before: the first stopped the run whatever the budget); from a set the service marked damaged,
    asked for leniently, the run reads on through its damaged shards (before: stopped at the first)."""
    directory = sets["root"] / "one"
    if source == "local":
        data = str(directory)
    else:
        data = f"{served}/v1/datasets/{'one' if source == 'http' else source}"
    out, cache = tmp_path / "run", tmp_path / "cache"
    through = ["--cache-dir", str(cache)] if cached else []
    run = train(data, out, "--epochs", "2", "--max-bad-samples", "1", *through,
                env=LENIENT if source == "marked" else None)
    assert run.returncode == 0 and exits(out) == {0: [0], 1: [0]}, run.stderr[-3000:]
    assert "Traceback" not in run.stdout + run.stderr
    bad = {split: key for split, (key, _) in sets["one"].items()}
    records = [r for path in (out / "clips").glob("*.jsonl") for r in read_file(str(path))]
    for epoch in (1, 2):
        steps = {r: sorted((x for x in records if x["epoch"] == epoch and x["rank"] == r),
                           key=lambda x: x["step"])
                 for r in (0, 1)}
        assert len(steps[0]) == len(steps[1]) == CLIPS // (2 * BATCH)
        # one model on both ranks at every step: the left-out sample changed nothing between them
        assert [x["weights"] for x in steps[0]] == [x["weights"] for x in steps[1]]
        trained = Counter(k for r in (0, 1) for x in steps[r] for k in x["keys"])
        assert trained == Counter(set(keys_of(directory, "train")) - {bad["train"]})  # every good clip once
    listed = [json.loads(line) for line in (out / "bad-samples.jsonl").read_text().splitlines()]
    assert sorted((r["epoch"], r["split"], r["key"]) for r in listed) == [
        (1, "train", bad["train"]), (1, "val", bad["val"]), (2, "train", bad["train"]),
        (2, "val", bad["val"])]
    assert ({r["url"].split("/")[-2] for r in listed} == {"train", "val"}
            and all(r["rank"] in (0, 1) for r in listed))
    epochs = [r for r in metrics.read(str(out / "metrics.jsonl")) if r["event"] == "epoch"]
    assert [(r["bad_samples"], r["val_bad_samples"], r["val_samples"])
            for r in epochs] == [(1, 1, VAL - 1)] * 2
    warned = [line for r in (0, 1) for line in rank_lines(run, r) if "left out (--max-bad-samples 1)" in line]
    assert len(warned) == 2 and all("(read twice)" in line for line in warned)  # once a sample, by rank 0
    if cached:  # each damaged shard downloaded once for the node, kept aside, never under its own name
        manifest = Manifest.load(str(directory))
        damaged = [s.sha256 for split in manifest.splits.values() for s in split.shards
                   if s.name in {shard for _, shard in sets["one"].values()}]
        assert sorted(p.name
                      for p in cache.glob("*/*.damaged.tar")) == sorted(f"{d}.damaged.tar" for d in damaged)
        assert not any((cache / d[:2] / f"{d}.tar").exists() for d in damaged)


@pytest.mark.long
def test_two_ranks_stop_alike_at_the_first_bad_sample_or_past_the_budget(sets, tmp_path):
    """Default: the rank that met it says so in one line (shard, sample, both digests, URL), the other
    that its peer stopped; past --max-bad-samples every rank stops at the same step with one line."""
    directory = sets["root"] / "two"
    out = tmp_path / "default"
    run = train(str(directory), out, "--epochs", "1")
    assert run.returncode == 1 and exits(out) == {0: [1], 1: [1]}, run.stderr[-3000:]
    errors = {r: [line for line in rank_lines(run, r) if "trainer train: error: " in line] for r in (0, 1)}
    assert all(len(e) == 1 for e in errors.values()) and not any("Traceback" in line for r in (0, 1)
                                                                 for line in rank_lines(run, r))
    # one bad sample in each rank's share here
    met = [e[0] for e in errors.values() if "(read twice)" in e[0]]
    # every rank stops on the fault the ranks agreed on, naming the rank that met it
    assert met and all(any(re.search(rf"error: rank [01]: "
                                     rf"{re.escape(f'{directory}/{shard}: shard {shard}, sample {key}: ')}"
                                     "xxh3-64 digest ", line)
                           for key, shard in sets["two"]["train"]) for line in met)
    assert len(met) + sum("another rank of the job stopped" in e[0] for e in errors.values()) == 2

    out = tmp_path / "budget"
    run = train(str(directory), out, "--epochs", "1", "--max-bad-samples", "1")
    assert run.returncode == 1 and exits(out) == {0: [1], 1: [1]}, run.stderr[-3000:]
    for r in (0, 1):
        (line,) = [line for line in rank_lines(run, r) if "trainer train: error: " in line]
        assert ("error: rank 0: 2 samples of train in epoch 1 are bad (their digests differ from the "
                "manifest's, or the format refuses them), more than --max-bad-samples 1 allows (1); the "
                "last: ") in line
        assert f"all are listed in {out}/bad-samples.jsonl; stopped in epoch 1 after batch " in line
        assert line.endswith(f"checkpoint saved to {out}/checkpoint.pt: the same command with --resume "
                             "continues from there once that is repaired")
    steps = Counter(r["rank"] for path in (out / "clips").glob("*.jsonl") for r in read_file(str(path)))
    assert steps[0] == steps[1] > 0  # the same step on both ranks
    listed = [json.loads(line)["key"] for line in (out / "bad-samples.jsonl").read_text().splitlines()]
    assert sorted(listed) == sorted(key for key, _ in sets["two"]["train"])


@pytest.mark.long
def test_a_killed_run_resumed_lists_and_counts_each_bad_sample_once_an_epoch(sets, tmp_path):
    """SIGKILL in epoch 2 after its bad sample was listed; --resume goes on from the epoch-1 checkpoint,
    meets the sample again and lists it again: the line the killed run wrote after the checkpoint is
    dropped, so the list and the counts read as one run's."""
    out = tmp_path / "run"
    args = [sys.executable, FAULTRUN, "train", "--data", str(sets["root"] / "one"), "--output-dir", str(out),
            "--backend", "none", *FLAGS, "--epochs", "2", "--max-bad-samples", "1"]
    # epoch 2's last
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT": f"step:{2 * CLIPS // BATCH}:KILL:self"}
    killed = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    listed = lambda: sorted((r["epoch"], r["split"]) for r in map(json.loads,
                                                                  (out / "bad-samples.jsonl")  # noqa: E731
                                                                  .read_text().splitlines()))
    assert listed() == [(1, "train"), (1, "val"), (2, "train")]  # epoch 2's was met before the kill
    resumed = subprocess.run([*args, "--resume"], env={**env, "FAULT": ""}, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert listed() == [(1, "train"), (1, "val"), (2, "train"), (2, "val")]
    epochs = [r for r in metrics.read(str(out / "metrics.jsonl")) if r["event"] == "epoch"]
    assert [(r["epoch"], r["bad_samples"], r["val_bad_samples"]) for r in epochs] == [(1, 1, 1), (2, 1, 1)]
