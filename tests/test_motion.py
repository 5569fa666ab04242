"""TSM learns what a 2D network cannot: the direction of motion.

The real data path end to end: ``ingest synth`` videos whose four classes (a textured disc
moving left, right, up or down over a textured background) differ only in motion, so any
single frame fits every class -> ``ingest build`` (ffmpeg on Ray) -> shards -> loader ->
``trainer train``. The same short CPU run reaches high validation accuracy with the temporal
shift and stays near chance (25%) without it (TSN: frames averaged, order never seen).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ingest.build import build
from ingest.clips import ClipConfig
from ingest.synth import synthesize

pytestmark = pytest.mark.usefixtures("ray_local")

# The demo's run (scripts/demo.sh), a few minutes on 2 CPU cores: 64x64 videos, 4 frames per clip,
# 32 px crops, a ResNet-10 of width 16; TSM and TSN train side by side, one core each. Motion
# features appear after a few hundred steps, then TSM's accuracy jumps.
RUN = ["--segments", "4", "--depth", "10", "--width", "16", "--crop-size", "32", "--scale-size", "32",
       "--no-flip", "--batch-size", "16", "--epochs", "16", "--warmup-epochs", "1", "--lr-per-8", "0.1",
       "--workers", "0", "--print-freq", "8", "--no-tensorboard"]


def start(data, out, *extra) -> subprocess.Popen:
    out.mkdir()
    with open(out / "train.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "trainer", "train", "--data", str(data), "--output-dir",
                                 str(out), *RUN, *extra], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})


def final_val_top1(proc: subprocess.Popen, out) -> float:
    proc.wait(timeout=900)
    assert proc.returncode == 0, (out / "train.log").read_text()[-3000:]
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in epochs if r["event"] == "epoch"][-1]["val_top1"]


def test_tsm_learns_motion_direction_that_tsn_cannot(tmp_path):
    videos, data = tmp_path / "videos", tmp_path / "shards"
    synthesize(str(videos), classes=4, train_per_class=64, val_per_class=16, width=64, height=64, fps=10,
               seconds=2.0, workers=2)
    summary = build(str(videos), str(data), ClipConfig(frames=4, clips_per_video=4, short_side=32),
                    workers=2, shard_samples=64, splits=("train", "val"))
    assert summary.failed == 0 and summary.clips == 4 * 64 * 4 + 4 * 16

    runs = {"tsm": start(data, tmp_path / "tsm"), "tsn": start(data, tmp_path / "tsn", "--no-shift")}
    tsm, tsn = (final_val_top1(proc, tmp_path / name) for name, proc in runs.items())
    assert tsm >= 90, f"TSM reached only {tsm:.1f}% (TSN {tsn:.1f}%)"
    assert tsn <= 50, f"TSN reached {tsn:.1f}%: single frames should not tell the direction"
