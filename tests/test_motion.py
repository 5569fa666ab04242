"""TSM learns what a 2D network cannot, the direction of motion; so does a TSN on the stored motion fields.

The real data path end to end: ``ingest synth`` videos whose four classes (a textured disc
moving left, right, up or down over a textured background) differ only in motion, so any
single frame fits every class -> ``ingest build --motion mv`` (ffmpeg on Ray; the JPEGs are those
of a build without motion, the codec's motion vectors stored beside them) -> shards -> loader ->
``trainer train``. The same short CPU run reaches high validation accuracy with the temporal
shift and stays near chance (25%) without it (TSN: frames averaged, order never seen). A TSN of
the motion stream (``--modality motion``), which sees each frame's field instead of its pixels,
learns the direction in two epochs; it would stay at chance if the fields were zeros or belonged
to other clips. Its checkpoint is then tested (``trainer test`` rebuilds the motion network and
loader), fused with a short RGB run's (TSN's two streams: ``trainer test --fuse``, each stream's
scores weighted) and refused as the start of an RGB run. The TSM against TSN comparison needs the
demo's long run (16 epochs) and is marked ``long``; the motion stream's two epochs are in the suite.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers.fusion import assert_fused, probabilities, report_of

from ingest.build import build
from ingest.clips import ClipConfig
from ingest.synth import synthesize
from trainer import cli

pytestmark = pytest.mark.usefixtures("ray_local")

# The demo's run (scripts/demo.sh), a few minutes on 2 CPU cores: 64x64 videos, 4 frames per clip,
# 32 px crops, a ResNet-10 of width 16; TSM and TSN train side by side, one core each. Motion
# features appear after a few hundred steps, then TSM's accuracy jumps.
RUN = ["--segments", "4", "--depth", "10", "--width", "16", "--crop-size", "32", "--scale-size", "32",
       "--no-flip", "--batch-size", "16", "--epochs", "16", "--warmup-epochs", "1", "--lr-per-8", "0.1",
       "--workers", "0", "--print-freq", "8", "--no-tensorboard"]
# the motion stream needs no motion features of its own: the field is the motion
MOTION = ["--modality", "motion", "--no-shift", "--epochs", "2", "--warmup-epochs", "0.5", "--lr-per-8",
          "0.05"]


def start(data, out, *extra) -> subprocess.Popen:
    out.mkdir()
    with open(out / "train.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "trainer", "train", "--data", str(data),
                                 "--output-dir", str(out), *RUN, *extra],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})


def final_val_top1(proc: subprocess.Popen, out) -> float:
    proc.wait(timeout=900)
    assert proc.returncode == 0, (out / "train.log").read_text()[-3000:]
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in epochs if r["event"] == "epoch"][-1]["val_top1"]


@pytest.fixture(scope="module")
def direction_set(tmp_path_factory):
    work = tmp_path_factory.mktemp("directions")
    videos, data = work / "videos", work / "shards"
    synthesize(str(videos), classes=4, train_per_class=64, val_per_class=16, width=64, height=64, fps=10,
               seconds=2.0, workers=2)
    summary = build(str(videos), str(data), ClipConfig(frames=4, clips_per_video=4, short_side=32,
                                                       motion="mv"),
                    workers=2, shard_samples=64, splits=("train", "val"))
    assert summary.failed == 0 and summary.clips == 4 * 64 * 4 + 4 * 16
    return data


@contextlib.contextmanager
def started(direction_set, work, runs: dict[str, tuple[str, ...]]):
    """The ``runs`` (name: extra flags) started side by side; {name: (process, directory)}, a test
    waits for those it reads. Stops what is still running at the end."""
    procs = {}
    try:
        for name, extra in runs.items():
            procs[name] = start(direction_set, work / name, *extra)
        yield {name: (proc, work / name) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def runs(direction_set, tmp_path_factory):
    """The motion stream's run, and a one-epoch RGB TSM run to fuse it with (its accuracy is not read)."""
    with started(direction_set, tmp_path_factory.mktemp("runs"), {
            "motion": MOTION, "rgb": ("--epochs", "1", "--warmup-epochs", "0.5", "--lr-per-8",
                                      "0.05")}) as both:
        yield both


@pytest.mark.long  # the demo's run: motion features appear only after a few hundred steps
def test_tsm_learns_motion_direction_that_tsn_cannot(direction_set, tmp_path_factory):
    with started(direction_set, tmp_path_factory.mktemp("demo"), {"tsm": (), "tsn": ("--no-shift",)}) as runs:
        tsm, tsn = (final_val_top1(*runs[name]) for name in ("tsm", "tsn"))
        assert tsm >= 90, f"TSM reached only {tsm:.1f}% (TSN {tsn:.1f}%)"
        assert tsn <= 50, f"TSN reached {tsn:.1f}%: single frames should not tell the direction"


def test_a_motion_tsn_learns_the_direction_from_the_stored_fields(runs):
    motion = final_val_top1(*runs["motion"])
    assert motion >= 90, f"the motion stream's TSN reached only {motion:.1f}% (chance: 25%)"


TEST = ["--backend", "none", "--workers", "0"]


@pytest.fixture(scope="module")
def reports(runs, direction_set, tmp_path_factory):
    """``trainer test`` of the RGB run and of the motion run, then of the two fused (weights 1 and 2)."""
    work = tmp_path_factory.mktemp("reports")
    for name in ("rgb", "motion"):
        final_val_top1(*runs[name])
    alone = {name: report_of(work / f"{name}.json", "--checkpoint", str(runs[name][1] / "checkpoint.pt"),
                             "--data", str(direction_set), *TEST) for name in ("rgb", "motion")}
    fused = report_of(work / "fused.json", "--fuse", str(runs["rgb"][1]), str(runs["motion"][1]),
                      "--weights", "1", "2", "--data", str(direction_set), *TEST)
    return {**alone, "fused": fused}


def test_trainer_test_rebuilds_the_motion_network_from_its_checkpoint(reports):
    summary = reports["motion"]["summary"]
    assert summary["labeled_videos"] == 64 and summary["video_top1"] >= 90, summary


def test_an_rgb_and_a_motion_stream_fused_are_the_weighted_mean_of_each_streams_scores(runs, reports):
    """TSN's two streams: ``trainer test --fuse`` of an RGB run (frames) and the motion run, each
    rebuilt with its own network and loader (3 and 2 channels a frame), scores every video with
    the weighted mean of what each stream alone scores it."""
    classes = sorted(next(iter(reports["rgb"]["videos"].values()))["top5"])  # the four directions
    assert len(classes) == 4
    rgb, motion = (probabilities(reports[name]["videos"], classes) for name in ("rgb", "motion"))
    assert max((rgb[v] - motion[v]).abs().max().item() for v in rgb) > 0.01  # two different networks
    assert_fused(reports["fused"], [reports["rgb"], reports["motion"]],
                 [str(runs["rgb"][1]), str(runs["motion"][1])],
                 [1.0, 2.0], classes)


def _without_fields(data, out):
    """The same shard set, its manifest saying no motion was stored."""
    out.mkdir()
    for split in ("train", "val"):
        (out / split).symlink_to(data / split)
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["config"]["clip"]["motion"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    shutil.copy(data / "classes.txt", out / "classes.txt")
    return out


def test_motion_is_refused_in_one_line_without_fields_or_with_decoding_on_device(
        direction_set, tmp_path, capsys):
    plain = _without_fields(direction_set, tmp_path / "plain")
    cases = [(plain, [], f"{plain}: no motion fields for --modality motion; "
                         "build the set with ingest build --motion mv (or flow)"),
             (direction_set, ["--decode-on-device"],
              "--decode-on-device: the motion fields of --modality motion are PNGs decoded on the CPU")]
    for i, (data, extra, message) in enumerate(cases):
        status = cli.main(["train", "--data", str(data), "--output-dir", str(tmp_path / f"out{i}"),
                           "--backend", "none", *RUN, *MOTION, *extra])
        assert status == 2 and capsys.readouterr().err == f"trainer train: error: {message}\n"


def test_resuming_the_motion_run_as_rgb_is_refused(runs, direction_set, capsys):
    proc, out = runs["motion"]
    final_val_top1(proc, out)
    capsys.readouterr()
    assert cli.main(["train", "--data", str(direction_set), "--output-dir", str(out), "--resume",
                     "--backend", "none", *RUN, "--no-shift", "--epochs", "2", "--warmup-epochs", "0.5",
                     "--lr-per-8", "0.05"]) == 1
    refused = capsys.readouterr().err
    assert refused.startswith("trainer train: error: --resume refused: ") and refused.count("\n") == 1
    assert "--modality motion in the checkpoint, rgb now" in refused
