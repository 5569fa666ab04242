"""``ingest build`` end to end: real ffmpeg on small generated videos, real Ray, real shards."""
from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray
import webdataset as wds
from helpers import media
from PIL import Image

from ingest import staging
from ingest.build import build
from ingest.clips import ClipConfig
from ingest.jpeg import restart_interval
from ingest.outdir import ForeignFiles
from shards.format.manifest import STAGING_NAME, Manifest

pytestmark = pytest.mark.usefixtures("ray_local")
CFG = ClipConfig(frames=8, short_side=32)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def samples(out: Path, split: str) -> dict[str, dict]:
    """key -> {suffix: bytes} for every sample of a split, read with tarfile."""
    m = Manifest.load(str(out))
    found = {}
    for shard in m.splits[split].shards:
        with tarfile.open(out / shard.name) as tf:
            for info in tf:
                key, suffix = info.name.split(".", 1)
                found.setdefault(key, {})[suffix] = tf.extractfile(info).read()
    return found


@pytest.fixture(scope="module")
def class_tree(tmp_path_factory) -> Path:
    """2 classes x 3 train videos, 2 val videos each, 2 unlabeled test videos (flat)."""
    src = tmp_path_factory.mktemp("classes")
    for split, n in (("train", 3), ("val", 2)):
        for label in ("jump", "walk"):
            for i in range(n):
                media.make_video(src / split / label / f"{label}{i}.mp4", frames=24 + i, width=48, height=32)
    for i in range(2):
        media.make_video(src / "test" / f"t{i}.mp4", frames=20, width=48, height=32)
    return src


@pytest.fixture(scope="module")
def reference(class_tree, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref")
    build(str(class_tree), str(out), CFG, workers=2, shard_samples=3, videos_per_task=2)
    return out


def test_class_folder_layout_labels_and_class_list(reference):
    m = Manifest.load(str(reference))
    assert m.classes == ["jump", "walk"]
    assert (reference / "classes.txt").read_text() == "jump\nwalk\n"
    assert {s: m.splits[s].num_samples for s in m.splits} == {"train": 6, "val": 4, "test": 2}
    for split in ("train", "val"):
        for key, members in samples(reference, split).items():
            meta = json.loads(members["json"])
            assert meta["label"] == key[:4] and int(members["cls"]) == m.classes.index(key[:4])
            assert meta["source"] == f"{split}/{key[:4]}/{key[:-4]}.mp4"
            assert sorted(s for s in members if s.endswith(".jpg")) == [f"{t:02d}.jpg" for t in range(8)]
            assert {restart_interval(members[f"{t:02d}.jpg"]) for t in range(8)} == {1}  # the default
    for key, members in samples(reference, "test").items():
        assert "cls" not in members and json.loads(members["json"])["label"] is None
    shard = m.splits["test"].shards[0]
    assert shard.labels == [-1] * shard.num_samples


def test_val_clips_take_the_centre_frame_of_each_segment(reference):
    for key, members in samples(reference, "val").items():
        meta = json.loads(members["json"])
        n = meta["num_frames"]
        expected = [int(n / 8 / 2 + n / 8 * i) for i in range(8)]
        assert meta["frame_indices"] == expected
        seen = [media.frame_index_from_image(np.asarray(Image.open(io.BytesIO(members[f"{t:02d}.jpg"]))))
                for t in range(8)]
        assert seen == expected, key


def test_training_clips_store_the_frames_their_metadata_names(reference):
    for key, members in samples(reference, "train").items():
        meta = json.loads(members["json"])
        seen = [media.frame_index_from_image(np.asarray(Image.open(io.BytesIO(members[f"{t:02d}.jpg"]))))
                for t in range(8)]
        assert seen == meta["frame_indices"]
        assert meta["sampling"] == "random" and meta["frame_size"][1] == 32  # short side


def test_manifest_offsets_cut_valid_samples(reference):
    m = Manifest.load(str(reference))
    for split in m.splits.values():
        for shard in split.shards:
            data = (reference / shard.name).read_bytes()
            assert len(data) == shard.bytes
            for key, off, length in zip(shard.keys, shard.offsets, shard.lengths):
                with tarfile.open(fileobj=io.BytesIO(data[off:off + length])) as tf:
                    names = tf.getnames()
                assert names[0] == f"{key}.00.jpg" and names[-1] == f"{key}.json"


def test_same_output_bytes_for_any_worker_count(class_tree, reference, tmp_path):
    build(str(class_tree), str(tmp_path), CFG, workers=1, shard_samples=3, videos_per_task=5)
    assert tree_bytes(tmp_path) == tree_bytes(reference)


def test_builds_on_a_callers_pool_leave_it_running_and_write_the_same_bytes(class_tree, reference, tmp_path):
    """``build(..., tasks=)``: what bench/ingest.py's timed section runs on (a pool already started)."""
    from ingest.tasks.local_runtime import LocalTasks

    pool = LocalTasks(2)
    try:
        for out in (tmp_path / "a", tmp_path / "b"):
            build(str(class_tree), str(out), CFG, workers=2, shard_samples=3, tasks=pool)
            assert tree_bytes(out) == tree_bytes(reference)
            workers = psutil.Process().children(recursive=True)
            assert workers and all(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
        # the same workers, still up
        assert pool.result(pool.submit(os.getpid))[0] in {w.pid for w in workers}
    finally:
        pool.close()


def test_readable_by_webdataset(reference):
    m = Manifest.load(str(reference))
    urls = [str(reference / s.name) for s in m.splits["train"].shards]
    got = list(wds.WebDataset(urls, shardshuffle=False).decode("rgb").to_tuple("00.jpg", "cls", "json"))
    assert len(got) == 6
    img, cls, meta = got[0]
    assert img.shape[0] == 32 and cls in (0, 1) and meta["clip"] == 0


def test_rerun_of_a_finished_build_is_a_no_op_that_clears_what_killed_runs_left(
        class_tree, reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    left = [out / "train" / "train-000000.tar.tmp-0123abcd",  # a shard being written when killed
            out / "val" / "val-000042.tar",  # a shard of an earlier build with other cuts
            out / STAGING_NAME / "0123abcd.tar.tmp-89abcdef"]
    for p in left:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"partial")
    summary = build(str(class_tree), str(out), CFG, workers=2, shard_samples=3, videos_per_task=2)
    assert summary.reused
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before
    assert not (out / STAGING_NAME).exists()


def staged_videos(out: Path) -> int:
    """Videos whose staged batch is complete (its index is written last, atomically)."""
    return sum(len(json.loads(p.read_text())["videos"]) for p in out.glob(".staging/*.json"))


HOLDPOINT = str(Path(__file__).with_name("helpers") / "holdpoint.py")


def held(argv: list[str], target: str) -> subprocess.Popen:
    """``python -m ARGV`` in a process group of its own, held at ``target`` (tests/helpers/holdpoint.py);
    returns once it is held there (fails if it ended first)."""
    hold, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, HOLDPOINT, target, "-m", *argv],
                            env={**os.environ, "HOLD_FD": str(write_end)},
                            pass_fds=(write_end,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    os.close(write_end)
    with os.fdopen(hold) as f:
        if f.readline() != "held\n":
            proc.wait()
            raise AssertionError(f"{' '.join(argv[:2])} ended ({proc.returncode}) before {target}")
    return proc


def test_build_killed_at_random_points_and_rerun_with_other_flags_gives_the_same_set(
        class_tree, reference, tmp_path, ray_local):
    """SIGKILL to the build's process group while decoding (twice) and while packing, each rerun
    with other batching, worker count and timeout; the last rerun finishes. Each kill comes at a
    hold point (tests/helpers/holdpoint.py): once the driver has taken the N-th decoded batch (N drawn at
    random; tasks still in flight go on meanwhile), and once the first shard is packed (the others
    in flight). Every staged file under its final name is whole after each kill, and the finished
    set is the reference byte for byte: no video dropped or doubled, no temporary file, stale
    shard or staging left behind."""
    out = tmp_path / "out"
    base = ["ingest", "build", "--src", str(class_tree), "--out", str(out), "--short-side", "32",
            "--shard-samples", "3", "--address", ray_local.get_runtime_context().gcs_address]
    rng = random.Random(9)
    first = rng.randint(2, 5)  # of 16 one-video batches, two more in flight: at most 7 videos staged
    points = [  # (flags of the run, where it is held and killed, whether packing had begun)
        (["--videos-per-task", "1", "--workers", "1"], f"ray:get@{first}", False),
        (["--videos-per-task", "3", "--workers", "2", "--timeout", "300"], f"ray:get@{rng.randint(1, 2)}",
         False),
        # the first shard packed
        (["--videos-per-task", "2", "--workers", "1"], "ingest.build:ShardInfo", True),
    ]
    for flags, where, packing in points:
        proc = held(base + flags, where)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for index in out.glob(".staging/*.json"):  # whatever is under a final name is complete
            rec = json.loads(index.read_text())
            lengths = [s["length"] for v in rec["videos"] for s in v["samples"]]
            assert index.with_suffix(".tar").stat().st_size == sum(lengths)
        # test, train
        assert bool(list(out.glob("t*/*.tar"))) == packing and not (out / "manifest.json").exists()
        assert packing or staged_videos(out) < 16
    build(str(class_tree), str(out), CFG, workers=2, shard_samples=3, videos_per_task=4, timeout=60)
    assert tree_bytes(out) == tree_bytes(reference)


def test_staged_videos_are_reused_only_under_the_same_clip_options(class_tree, tmp_path):
    """Staging left by an earlier build (kept here, as a killed build leaves it) holds 32-pixel
    clips; a rerun with another short side must decode again, not pack the staged samples; so
    must a rerun without JPEG restart markers over staged samples that have them."""
    out = tmp_path / "out"
    build(str(class_tree), str(out), CFG, workers=2, shard_samples=4, splits=("val",), keep_staging=True)
    assert staged_videos(out) == 4
    build(str(class_tree), str(out), ClipConfig(frames=8, short_side=24), workers=2, shard_samples=4,
          splits=("val",), keep_staging=True, force=True)  # another set: replaced only when asked
    got = samples(out, "val")
    assert len(got) == 4
    for key, members in got.items():
        frames = [Image.open(io.BytesIO(members[f"{t:02d}.jpg"])) for t in range(8)]
        assert ({min(f.size) for f in frames} == {24}
                and json.loads(members["json"])["frame_size"][1] == 24), key
        assert restart_interval(members["00.jpg"]) == 1, key
    build(str(class_tree), str(out), ClipConfig(frames=8, short_side=24, restart_interval=0), workers=2,
          shard_samples=4, splits=("val",), force=True)
    assert Manifest.load(str(out)).config["clip"]["restart_interval"] == 0 and not (out / ".staging").exists()
    without = samples(out, "val")
    assert without.keys() == got.keys()
    for key, members in without.items():
        assert {restart_interval(members[f"{t:02d}.jpg"]) for t in range(8)} == {0}, key
        assert len(members["00.jpg"]) < len(got[key]["00.jpg"]), key  # the markers' bytes


def dying_once(marker: str, decode_batch):
    """``decode_batch`` (``ingest.staging``'s task), except that the first call of a build (the one
    that creates ``marker``, writing its pid there) SIGKILLs its own Ray worker mid-task: the batch
    decoded and its data file written, its index (what makes a batch staged) not yet."""
    def task(*args, **kwargs):
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return decode_batch(*args, **kwargs)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        write = staging.storage.atomic_write

        def die_before_the_index(url, data):
            if url.endswith(".json"):
                os.kill(os.getpid(), signal.SIGKILL)
            write(url, data)
        staging.storage.atomic_write = die_before_the_index
        return decode_batch(*args, **kwargs)
    task.__name__ = decode_batch.__name__  # the task's name; its module stays this one, sent by value
    return task


def test_a_ray_worker_killed_mid_task_is_retried_with_the_same_output(class_tree, reference, tmp_path,
                                                                      monkeypatch):
    """The build's first decode task kills its own worker (SIGKILL) between the batch's data file
    and its index: Ray retries the task on another worker, and the set is the reference's bytes."""
    # the task, sent to Ray's workers by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    marker = tmp_path / "killed"
    monkeypatch.setattr(staging, "decode_batch", dying_once(str(marker), staging.decode_batch))
    build(str(class_tree), str(tmp_path / "out"), CFG, workers=2, shard_samples=3, videos_per_task=4)
    killed = int(marker.read_text())
    assert killed != os.getpid() and not psutil.pid_exists(killed)
    assert tree_bytes(tmp_path / "out") == tree_bytes(reference)


def test_a_build_without_ray_writes_the_same_bytes_with_the_same_code(class_tree, reference, tmp_path):
    """The local worker processes of a small build (ingest.tasks.runtime) run the same tasks as Ray's:
    the set is the Ray-built reference byte for byte, and every task ran in them."""
    summary = build(str(class_tree), str(tmp_path), CFG, workers=2, shard_samples=3, runner="local")
    assert set(summary.tasks_per_node) == {"local"}
    assert tree_bytes(tmp_path) == tree_bytes(reference)


def test_a_task_submitted_after_a_local_worker_died_starts_a_new_pool():
    """A worker dies between two submissions (its pool broken before the next task is sent): the
    next submit starts a new pool, and the dead worker's task runs again there. Before: the build
    ended in ``BrokenProcessPool`` (a fresh clone's suite, the test below killing a worker before
    the build had sent all its tasks). The worker is killed, and the pool seen broken (its task's
    future failed), before the second submit: no race."""
    from concurrent.futures.process import BrokenProcessPool

    from ingest.tasks.local_runtime import LocalTasks

    tasks = LocalTasks(1)
    try:
        first = tasks.submit(time.sleep, 0.5)
        # the executor's own list (started by submit)
        workers = [p.pid for p in first.pool._processes.values()]
        assert workers
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        # the pool is marked broken first
        assert isinstance(first.future.exception(timeout=60), BrokenProcessPool)
        second = tasks.submit(os.getpid)
        pid, _ = tasks.result(second)
        assert pid not in workers  # a worker of the new pool
        assert tasks.result(first)[0] is None and first.tries == 1  # sent again, once, and run
    finally:
        tasks.close()


def test_a_local_worker_killed_mid_task_is_retried_with_the_same_output(class_tree, reference, tmp_path):
    """SIGKILL to a worker process of a build without Ray: its tasks run again in a new pool, as
    Ray retries a task whose worker died, and the set is the reference byte for byte."""
    killed, stop = [], threading.Event()

    def kill_one_worker():  # the workers: forked by the fork server this process started
        while not killed and not stop.is_set():
            for server in psutil.Process().children():
                if "forkserver" in " ".join(server.cmdline()):
                    for worker in server.children():
                        os.kill(worker.pid, signal.SIGKILL)
                        killed.append(worker.pid)
                        break
            time.sleep(0.01)

    killer = threading.Thread(target=kill_one_worker)
    killer.start()
    try:
        build(str(class_tree), str(tmp_path), CFG, workers=2, shard_samples=3, runner="local")
    finally:
        stop.set()
        killer.join()
    assert killed
    assert tree_bytes(tmp_path) == tree_bytes(reference)


@pytest.mark.parametrize("sizes, parallel, batches", [
    ([100] * 16, 2, [4, 3, 3, 2, 1, 1, 1, 1]),  # each a quarter of what is left: shrinking to single videos
    ([100] * 8, 2, [2, 2, 1, 1, 1, 1]),
    ([100] * 120, 2, [8] * 12 + [6, 5, 4, 3, 2, 1, 1, 1, 1]),  # never more than 8 videos a task
    # a long video is a task of its own
    ([800, 100, 100, 100, 100, 100, 100, 100, 100], 2, [1, 2, 2, 1, 1, 1, 1]),
    ([-1, 100, 100], 1, [2, 1]),  # a directory (size -1) costs nothing to decode: it joins the next video
])
def test_tasks_are_sized_from_the_videos_bytes_and_the_workers(sizes, parallel, batches):
    from ingest.build import plan_batches
    from ingest.sources import Video

    videos = [Video("train", f"train/a/{i}.mp4", f"/v/{i}.mp4", "a", str(i), size) for i,
              size in enumerate(sizes)]
    planned = plan_batches(videos, parallel)
    assert [len(b) for b in planned] == batches and [v for b in planned for v in b] == videos
    assert [len(b) for b in plan_batches(videos, parallel,
                                         3)] == [3] * (len(sizes) // 3) + [len(sizes) % 3] * bool(
        len(sizes) % 3)


def test_cvdf_layout_with_annotation_csvs(tmp_path):
    src = tmp_path / "k400"
    rows = {"train": [("abseiling", "aaa", 10, 20), ('tying bow tie, "fancy"', "b-b", 0, 10),
                      ("abseiling", "missing", 5, 15), ("", "nolabel", 0, 10)],
            "val": [("riding a bike", "ccc", 30, 40)]}
    (src / "annotations").mkdir(parents=True)
    for split, rs in rows.items():
        lines = ["label,youtube_id,time_start,time_end,split,is_cc"]
        for label, yt, a, b in rs:
            q = '"' + label.replace('"', '""') + '"' if ("," in label or " " in label) else label
            lines.append(f"{q},{yt},{a},{b},{split},0")
            if yt != "missing":
                media.make_video(src / split / f"{yt}_{a:06d}_{b:06d}.mp4", frames=16, width=48, height=32)
        (src / "annotations" / f"{split}.csv").write_text("\n".join(lines) + "\n",
                                                         encoding="utf-8-sig" if split == "val" else "utf-8")
    (src / "annotations" / "test.csv").write_text("youtube_id,time_start,time_end,split\nddd,1,11,test\n")
    media.make_video(src / "test" / "ddd_000001_000011.mp4", frames=16, width=48, height=32)
    out = tmp_path / "out"
    summary = build(str(src), str(out), CFG, workers=2, shard_samples=10)
    assert summary.missing == 1 and summary.failed == 1
    assert summary.line().endswith(f"1 annotated video not found; failures: 1 x unlabeled (each listed in "
                                   f"{out / 'errors.jsonl'})")
    assert [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()] == [
        {"path": "train/missing_000005_000015", "split": "train", "ffmpeg": "", "warning": "not found",
         "reason": "annotations/train.csv line 4 names it, no file is there"},  # before: only counted
        {"path": "train/nolabel_000000_000010.mp4", "split": "train", "ffmpeg": "",
         "reason": "unlabeled: no label in annotations/train.csv"}]
    m = Manifest.load(str(out))
    assert m.classes == sorted(["abseiling", 'tying bow tie, "fancy"', "riding a bike"])
    got = {k: (json.loads(v["json"])["label"], int(v["cls"])) for k, v in samples(out, "train").items()}
    assert got == {"aaa_000010_000020_c00": ("abseiling", 0),
                   "b-b_000000_000010_c00": ('tying bow tie, "fancy"', 2)}
    assert int(samples(out, "val")["ccc_000030_000040_c00"]["cls"]) == 1
    assert "cls" not in samples(out, "test")["ddd_000001_000011_c00"]


def test_an_out_holding_another_tools_files_is_taken_only_with_force(tmp_path):
    """Before: a shard named as webdataset names them (val/val-000000.tar) in an --out without a
    manifest was replaced silently. Refused, it is left as it was; --force builds into the directory."""
    src = tmp_path / "src"
    media.make_video(src / "val" / "a" / "v.mp4", frames=8, width=40, height=30)
    out = tmp_path / "out"
    (out / "val").mkdir(parents=True)
    (out / "val" / "val-000000.tar").write_bytes(b"another tool's")
    with pytest.raises(ForeignFiles, match=r"holds 1 file no build of this project wrote \(such as val/"):
        build(str(src), str(out), CFG, workers=1)
    assert sorted(p.name for p in out.rglob("*")) == ["val", "val-000000.tar"]
    assert (out / "val" / "val-000000.tar").read_bytes() == b"another tool's"
    build(str(src), str(out), CFG, workers=1, force=True)
    assert sorted(samples(out, "val")) == ["v_c00"]
    build(str(src), str(out), CFG, workers=1)  # a set of ours now: up to date


def test_several_training_clips_per_video_differ(tmp_path):
    src = tmp_path / "src"
    media.make_video(src / "train" / "a" / "v.mp4", frames=60, width=40, height=30)
    out = tmp_path / "out"
    build(str(src), str(out), ClipConfig(short_side=30, clips_per_video=3), workers=2, shard_samples=10)
    got = {k: json.loads(v["json"])["frame_indices"] for k, v in samples(out, "train").items()}
    assert sorted(got) == ["v_c00", "v_c01", "v_c02"]
    assert len({tuple(v) for v in got.values()}) == 3


def test_remote_source_over_http_matches_local(class_tree, tmp_path):
    """Workers fetch each video themselves (to a local temporary file: ffmpeg needs to seek)."""
    from helpers.shardsets import serve

    local, remote = tmp_path / "local", tmp_path / "remote"
    build(str(class_tree), str(local), CFG, workers=2, shard_samples=3, splits=("val",))
    with serve(str(class_tree)) as (url, requests):
        build(url, str(remote), CFG, workers=2, shard_samples=3, splits=("val",))
    assert sum(1 for method, path in requests if method == "GET" and path.endswith(".mp4")) >= 4
    a, b = tree_bytes(local), tree_bytes(remote)
    assert a.keys() == b.keys()
    assert {k: v for k, v in a.items() if k != "manifest.json"} == \
           {k: v for k, v in b.items() if k != "manifest.json"}  # the manifest records its src


def test_frames_kept_at_their_size_are_stored_as_ffmpeg_decodes_them_and_identically_twice(tmp_path):
    """340x256 is the common pre-resized Kinetics size: frames of that short side are not resized,
    and at widths that are not multiples of 16 the last columns once held run-to-run garbage."""
    src = tmp_path / "src"
    for label, width in (("a", 340), ("b", 354), ("c", 338)):
        media.make_video(src / "train" / label / f"{label}0.mp4", frames=12, width=width, height=256,
                         texture=True)
    cfg = ClipConfig(frames=4, short_side=256)
    build(str(src), str(tmp_path / "one"), cfg, workers=1, shard_samples=2, videos_per_task=3)
    build(str(src), str(tmp_path / "two"), cfg, workers=2, shard_samples=2, videos_per_task=1)
    assert tree_bytes(tmp_path / "one") == tree_bytes(tmp_path / "two")
    for key, members in samples(tmp_path / "one", "train").items():
        meta = json.loads(members["json"])
        full = media.decode_frames(src / meta["source"])
        for t, i in enumerate(meta["frame_indices"]):
            stored = np.asarray(Image.open(io.BytesIO(members[f"{t:02d}.jpg"])).convert("RGB"), np.int16)
            assert stored.shape == full[i].shape
            by_column = np.abs(stored - full[i]).mean(axis=(0, 2))  # JPEG's loss: a few levels
            assert by_column.max() < 20, (f"{key} frame {i}: column {by_column.argmax()} off by "
                                          f"{by_column.max():.1f}")
