"""A checkpoint written by the trainer before its redesign (tests/fixtures/checkpoint-v0, README there)
still resumes bit for bit and is accepted by ``trainer test``: the file format outlives the code.

The fixture was stopped mid-epoch by SIGTERM; resumed here with today's trainer it must end with
the very weights, momentum buffers and metrics of the uninterrupted run made by the old code.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).with_name("fixtures") / "checkpoint-v0"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FLAGS = ["--backend", "none", "--segments", "4", "--depth", "10", "--width", "4", "--crop-size", "24",
         "--scale-size", "28", "--batch-size", "2", "--epochs", "2", "--warmup-epochs", "1",
         "--lr-per-8", "0.05", "--dropout", "0.5", "--workers", "1", "--print-freq", "1", "--no-tensorboard"]


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for key, value in state.items():
        h.update(key.encode())
        h.update(value.contiguous().numpy().tobytes())
    return h.hexdigest()


def records(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if "time" not in k and k != "clips_per_s"}
            for line in path.read_text().splitlines()]


def test_old_checkpoint_resumes_bitwise_to_the_old_uninterrupted_run(tmp_path):
    expected = json.loads((FIXTURE / "expected.json").read_text())["uninterrupted"]
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(FIXTURE / "checkpoint.pt", out)
    shutil.copy(FIXTURE / "metrics.jsonl", out)
    run = subprocess.run([sys.executable, "-m", "trainer", "train", "--data", str(FIXTURE / "data"),
                          "--output-dir", str(out), "--resume", *FLAGS],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("resumed from" in run.stderr
            and "in epoch 1, after batch 3 (step 3," in run.stderr), run.stderr[-3000:]
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert (state["clips_seen"], state["step"]) == (expected["clips_seen"], expected["step"])
    assert digest(state["model"]) == expected["model_sha256"]
    momentum = {str(i): s["momentum_buffer"] for i, s in state["optimizer"]["state"].items()}
    assert digest(momentum) == expected["momentum_sha256"]
    # the old code numbered train records' epochs from 0; today's from 1, as everything else does
    kept = len((FIXTURE / "metrics.jsonl").read_text().splitlines())
    renumbered = [r | {"epoch": r["epoch"] + 1} if r["event"] == "train" else r
                  for r in expected["records"][kept:]]
    assert records(out / "metrics.jsonl") == expected["records"][:kept] + renumbered


def test_old_checkpoint_is_tested_as_before(tmp_path):
    out = tmp_path / "test.json"
    run = subprocess.run([sys.executable, "-m", "trainer", "test",
                          "--checkpoint", str(FIXTURE / "checkpoint.pt"), "--data", str(FIXTURE / "data"),
                          "--backend", "none", "--workers", "1", "--output", str(out)],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    tested = json.loads(out.read_text())
    assert tested["summary"].pop("arch") == "tsm"  # a checkpoint from before --arch is a TSM's
    assert tested == json.loads((FIXTURE / "expected.json").read_text())["test"]
