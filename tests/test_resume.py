"""A run stopped by real signals at every kind of point, and killed, and resumed each time ends
bitwise equal to an uninterrupted run, with the same metrics step by step.

Bitwise, not merely close, because on CPU every step is deterministic for a fixed thread
count, and the checkpoint restores everything the rest of the run depends on: weights,
momentum buffers, clips seen (the learning rate), the loader's place in the epoch (with a
forked worker), the epoch's training sums and the RNG state that draws dropout masks.
Its output is a log's (stderr is a pipe): progress lines, and each resume says where it resumed.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.shardsets import make_shardset

EPOCHS, STEPS_PER_EPOCH, TRAIN_CLIPS = 2, 6, 24
FAULTRUN = str(Path(__file__).with_name("helpers") / "faultrun.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "KF_PROGRESS_SECONDS": "0"}  # a progress line every step
# (fault, exit code, checkpoint's (epoch, batch, step) after it): the four points and the end
STOPS = [
    ("step:1:TERM:group", 143, (0, 1, 1)),  # first step; the whole process group, loader worker too
    ("step:2:INT:group", 130, (0, 3, 3)),  # mid-epoch: Ctrl-C in a terminal signals the group
    ("step:3:TERM:self", 143, (0, 6, 6)),  # the epoch's last step: validation still to run
    ("validated:1:TERM:self", 143, (1, 0, 6)),  # just after validation (between epochs)
    # SIGKILL in step 10: back to the checkpoint of step 8, step 9 redone
    ("step:4:KILL:group", -9, (1, 2, 8)),
    ("", 0, (EPOCHS, 0, EPOCHS * STEPS_PER_EPOCH)),
]


def train(data, out, fault="", *extra) -> subprocess.CompletedProcess:
    return subprocess.run([
        sys.executable, FAULTRUN, "train", "--data", str(data), "--output-dir", str(out), "--backend", "none",
        "--segments", "4", "--depth", "10", "--width", "8", "--crop-size", "32", "--scale-size", "36",
        "--batch-size", "4", "--epochs", str(EPOCHS), "--warmup-epochs", "1", "--lr-per-8", "0.05",
        "--dropout", "0.5", "--workers", "1", "--print-freq", "1", "--checkpoint-steps", "2",
        "--no-tensorboard", *extra],
        env={**ENV, "FAULT": fault}, capture_output=True, text=True, timeout=300,
        start_new_session=True)  # a signal to the process group reaches the trainer and its workers only


def records(out) -> list[dict]:
    """metrics.jsonl without the timings (which differ between runs)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if "time" not in k and k != "clips_per_s"}
            for line in lines]


@pytest.mark.long  # six whole runs stopped and resumed (about a minute): a long run's
def test_stopped_at_first_middle_last_step_after_validation_or_killed_resumes_bitwise(tmp_path):
    data = tmp_path / "data"
    make_shardset(str(data), {"train": TRAIN_CLIPS, "val": 8}, per_shard=5, num_classes=3, frames=4,
                  size=(48, 40))

    straight = train(data, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    # stderr is a pipe, not a terminal: progress as lines (before: a bar redrawn with "\r" per refresh)
    lines = straight.stderr.splitlines()
    assert "\r" not in straight.stderr
    steps = [line for line in lines if re.match(r"epoch 1/2: \d/6 steps \(\d+%\), [\d.]+ steps/s, ETA "
                                                  r"\d:\d\d:\d\d; loss [\d.]+, lr [\d.e+-]+, clips/s [\d.]+, "
                                                  r"data ms \d+, compute ms \d+$", line)]
    assert [int(line.split()[2].split("/")[0]) for line in steps] == [1, 2, 3, 4, 5], lines
    assert sum(bool(re.match(r"epoch 2/2: 6/6 steps in \d:\d\d:\d\d, [\d.]+ steps/s; loss", line))
               for line in lines) == 1

    broken = tmp_path / "broken"
    for i, (fault, code, position) in enumerate(STOPS):
        run = train(data, broken, fault, *(["--resume"] if i else []))
        assert run.returncode == code, (fault, run.stderr[-3000:])
        ckpt = torch.load(broken / "checkpoint.pt", weights_only=True)
        assert (ckpt["epoch"], ckpt["batch"], ckpt["step"]) == position, fault
        if code > 0:
            assert "checkpoint saved" in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
        if i:
            epoch, batch, step = STOPS[i - 1][2]
            where = (f"in epoch {epoch + 1}, after batch {batch}" if batch
                     else f"at the start of epoch {epoch + 1}")
            assert f"resumed from {broken / 'checkpoint.pt'} {where} (step {step}," in run.stderr
    again = train(data, broken, "", "--resume")  # a finished run resumed: before, "in epoch 3, after batch 0"
    assert (again.returncode == 0
            and f"after its last epoch ({EPOCHS} of {EPOCHS}): nothing is left to train" in again.stderr
            and f"epoch {EPOCHS + 1}" not in again.stderr), again.stderr[-3000:]

    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    b = torch.load(broken / "checkpoint.pt", weights_only=True)
    assert a["clips_seen"] == b["clips_seen"] == EPOCHS * TRAIN_CLIPS
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"])
    assert torch.equal(a["rng"][0]["torch"], b["rng"][0]["torch"])
    # every step once (the killed run's step 9 is logged again, not twice), with the same loss and
    # learning rate; the epochs' train and val metrics alike
    assert records(broken) == records(tmp_path / "straight")
    assert [r["epoch"] for r in records(broken) if r["event"] == "epoch"] == [1, 2]
