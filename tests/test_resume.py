"""A run stopped by SIGTERM mid-epoch and resumed ends bitwise equal to an uninterrupted run.

Bitwise, not merely close, because on CPU every step is deterministic for a fixed thread
count, and the checkpoint restores everything the rest of the run depends on: weights,
momentum buffers, schedule position, the loader's place in the epoch (with a forked worker)
and the RNG state that draws dropout masks.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch
from shardsets import make_shardset

EPOCHS, STEPS_PER_EPOCH = 2, 12
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(data, out, *extra) -> subprocess.Popen:
    return subprocess.Popen([
        sys.executable, "-m", "trainer", "train", "--data", str(data), "--output-dir", str(out), "--val-split", "",
        "--segments", "4", "--depth", "10", "--width", "8", "--crop-size", "32", "--scale-size", "36",
        "--batch-size", "4", "--epochs", str(EPOCHS), "--warmup-epochs", "1", "--lr-per-8", "0.05",
        "--dropout", "0.5", "--workers", "1", "--print-freq", "1", "--no-tensorboard", *extra],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=300)
    return proc.returncode, output


def logged_steps(out) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()), default=0)


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    data = tmp_path / "data"
    make_shardset(str(data), {"train": 48}, per_shard=10, num_classes=3, frames=4, size=(48, 40))

    code, output = finish(train(data, tmp_path / "straight"))
    assert code == 0, output[-3000:]

    broken = tmp_path / "broken"
    proc = train(data, broken)
    deadline = time.monotonic() + 240
    while logged_steps(broken) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "checkpoint saved" in output
    stopped = torch.load(broken / "checkpoint.pt", weights_only=True)
    assert stopped["epoch"] == 0 and 2 <= stopped["batch"] < STEPS_PER_EPOCH  # mid-epoch

    code, output = finish(train(data, broken, "--resume"))
    assert code == 0, output[-3000:]
    assert f"resumed from {broken / 'checkpoint.pt'} at epoch 0, batch {stopped['batch']}" in output

    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    b = torch.load(broken / "checkpoint.pt", weights_only=True)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (EPOCHS, EPOCHS * STEPS_PER_EPOCH)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"])
    assert a["clips_seen"] == b["clips_seen"] == EPOCHS * 48
    assert torch.equal(a["rng"][0]["torch"], b["rng"][0]["torch"])
