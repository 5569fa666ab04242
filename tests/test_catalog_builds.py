"""``ingest build --catalog``: real ffmpeg, real Ray, a real catalog on each back end (a SQLite
file; a PostgreSQL database on a server on loopback). A build is found again by its inputs and
options (nothing decoded, even for another --out), ids change exactly when the bytes can, and a
build whose process is killed is taken over by the one waiting for it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import media

from ingest import registry
from ingest.clips import ClipConfig
from shards.catalog import Catalog
from shards.format.manifest import Manifest

pytestmark = pytest.mark.usefixtures("ray_local")
CFG = ClipConfig(frames=8, short_side=32)
OPTS = dict(shard_samples=3)
HOLDPOINT = str(Path(__file__).with_name("helpers") / "holdpoint.py")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    src = tmp_path_factory.mktemp("videos")
    for split, n in (("train", 2), ("val", 1)):
        for label in ("jump", "walk"):
            for i in range(n):
                media.make_video(src / split / label / f"{label}{i}.mp4", frames=24 + i, width=48, height=32)
    return src


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def built(request, tree, tmp_path_factory):
    root = tmp_path_factory.mktemp("built")
    if request.param == "sqlite":
        catalog = str(root / "catalog.sqlite")
    else:
        catalog = request.getfixturevalue("postgres").database()
    summary, record = registry.build(catalog, str(tree), str(root / "first"), CFG, workers=2,
                                     videos_per_task=2, **OPTS)
    assert not summary.reused and record.state == "ready"
    return catalog, record, root


def test_identical_build_is_reused_without_decoding_even_to_another_out(tree, built):
    catalog, record, root = built
    out = root / "second"
    proc = subprocess.run([sys.executable, "-m", "ingest", "build", "--catalog", catalog, "--src", str(tree),
                           "--out", str(out), "--short-side", "32", "--shard-samples", "3", "--workers", "1",
                           "--videos-per-task", "5", "--timeout", "99"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"reused dataset {record.id} (first) at {root / 'first'}" in proc.stdout
    assert not out.exists()  # nothing staged, nothing decoded, nothing written
    rec = Catalog(catalog).get(record.id)
    assert rec.attempts == 1 and rec.location == str(root / "first")
    m = Manifest.load(rec.location)
    assert rec.splits == {s: {"clips": m.splits[s].num_samples, "bytes": m.splits[s].num_bytes,
                              "shards": len(m.splits[s].shards), "failed": 0} for s in ("train", "val")}
    assert rec.files["manifest.json"][1] == rec.manifest_sha256 and rec.builder_version


def test_id_changes_with_inputs_and_output_options_only(tree, built, tmp_path):
    _, record, _ = built
    same = lambda p: p.id == record.id  # noqa: E731
    assert same(registry.plan(str(tree), CFG, **OPTS))
    assert same(registry.plan(os.path.relpath(tree), CFG, **OPTS))  # another spelling of the same source
    assert same(registry.plan(str(tree), CFG, shard_size=10**6, **OPTS))  # shard_samples decides the cut
    assert not same(registry.plan(str(tree), ClipConfig(frames=8, short_side=24), **OPTS))
    assert not same(registry.plan(str(tree), ClipConfig(frames=8, short_side=32, quality=80), **OPTS))
    assert not same(registry.plan(str(tree), CFG, shard_samples=4))
    assert not same(registry.plan(str(tree), CFG, splits=("train",), **OPTS))
    video = tree / "train" / "jump" / "jump0.mp4"
    stat = video.stat()
    os.utime(video, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same size, newer file
    try:
        assert not same(registry.plan(str(tree), CFG, **OPTS))
    finally:
        os.utime(video, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert same(registry.plan(str(tree), CFG, **OPTS))
    (tree / "val" / "zzz_empty_class").mkdir()  # shifts no file, but adds a class
    try:
        assert not same(registry.plan(str(tree), CFG, **OPTS))
    finally:
        (tree / "val" / "zzz_empty_class").rmdir()


def test_killed_build_is_taken_over_by_the_build_waiting_for_it(tree, built, ray_local, monkeypatch):
    catalog, _, root = built
    cfg = ClipConfig(frames=8, short_side=32, seed=7)  # a new id
    dataset = registry.plan(str(tree), cfg, **OPTS).id
    first, second = root / "killed", root / "waiter"
    # the builder is held once it has recorded its first video done: alive and heartbeating, mid-build
    hold, held = os.pipe()
    proc = subprocess.Popen([sys.executable, HOLDPOINT, "shards.catalog:Catalog.set_progress", "-m", "ingest",
                             "build", "--catalog", catalog, "--src", str(tree), "--out", str(first),
                             "--short-side", "32", "--seed", "7", "--shard-samples", "3",
                             "--workers", "1", "--videos-per-task", "1",
                             "--address", ray_local.get_runtime_context().gcs_address],
                            env={**os.environ, "HOLD_FD": str(held)}, pass_fds=(held,),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    os.close(held)
    try:
        with os.fdopen(hold) as f:
            assert f.readline() == "held\n", f"the build ended ({proc.wait()}) before reporting progress"
        cat = Catalog(catalog)
        rec = cat.get(dataset)
        assert rec.state == "building" and rec.owner["pid"] == proc.pid and rec.progress["videos_done"] == 1

        waits, claim = threading.Semaphore(0), registry.claim

        def counted(*args, **kwargs):  # each time the waiter finds the build still owned by a live builder
            c = claim(*args, **kwargs)
            if c.action == "wait":
                waits.release()
            return c

        monkeypatch.setattr(registry, "claim", counted)
        results = []
        waiter = threading.Thread(target=lambda: results.append(registry.build(
            catalog, str(tree), str(second), cfg, poll=0.2, workers=2, videos_per_task=1, **OPTS)))
        waiter.start()
        assert all(waits.acquire(timeout=120) for _ in range(3))  # it found the live builder three times...
        assert waiter.is_alive() and cat.get(dataset).owner["pid"] == proc.pid  # ...and kept waiting
    finally:  # the held build ends here, also when an assertion above failed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    waiter.join(timeout=240)
    summary, rec = results[0]
    assert rec.state == "ready" and rec.attempts == 2 and rec.location == str(first)
    assert not second.exists() and not summary.reused  # resumed where the killed one left its work
    assert Manifest.load(str(first)).splits["train"].num_samples == 4
    assert json.loads((first / "manifest.json").read_text())["config"]["clip"]["seed"] == 7
