"""Multigrid and K-step averaging through ``trainer train`` on two Horovod ranks, stopped and resumed.

One straight run and one run stopped by SIGTERM to a single rank, then resumed, both with
``--multigrid both --average-every 2 --trace-steps``: every rank logs each step's shape, batch,
learning rate and a weight checksum. The traces show every rank on the same shape at every step,
the shapes the schedule gives for the global iteration, ranks identical after every averaging
step and apart between, and the resumed run landing mid-schedule on the same shape, batch, rate
and weights as the straight run, step for step to the end.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.shardsets import make_shardset

from trainer import metrics
from trainer.clip_log import read
from trainer.schedules.multigrid import Schedule, plan

HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
FAULTRUN = str(Path(__file__).with_name("helpers") / "faultrun.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TRAIN, EPOCHS, STAGES = 40, 4, (2, 3)  # 4 baseline epochs -> the plan's 6
# epoch 3 is steps 12-20, three loader batches (periods) of 3 steps; with K=2 the only step of it
# where a run may stop (a period's end and a synchronising step) is step 17: signalled as step 13
# starts (its 14th step, tests/helpers/faultrun.py), the run stops after 18 steps, mid-epoch
SIGNAL_AT, STOP_STEPS, STOP_EPOCH, STOP_BATCH = 14, 18, 3, 2
FLAGS = ["--segments", "8", "--depth", "10", "--width", "8", "--crop-size", "32", "--scale-size", "36",
         "--batch-size", "1", "--epochs", str(EPOCHS), "--warmup-epochs", "1", "--lr-per-8", "0.05",
         "--workers", "1", "--print-freq", "1", "--no-tensorboard", "--multigrid", "both",
         "--multigrid-stages", *map(str, STAGES), "--average-every", "2", "--trace-steps", "--val-split", ""]


def launch(data: Path, out: Path, *extra, env: dict = ENV) -> subprocess.Popen:
    return subprocess.Popen([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, FAULTRUN,
                             "train", "--data", str(data), "--output-dir", str(out), *FLAGS, *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=300)
    return output


def trace(out: Path, rank: int) -> list[dict]:
    path = out / f"steps-rank{rank}.jsonl"
    return metrics.read(str(path)) if path.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("mgtrain")
    data = tmp / "data"
    manifest = make_shardset(str(data), {"train": TRAIN}, per_shard=7, frames=8, size=(48, 40))
    straight, broken = tmp / "straight", tmp / "broken"
    first = launch(data, straight, "--clip-log")
    # both at once: two ranks each on two shared cores; one rank signals itself a step into epoch 3,
    # and every rank stops at the same step
    proc = launch(data, broken, env={**ENV, "FAULT": f"step:{SIGNAL_AT}:TERM:self", "FAULT_RANK": "1"})
    stopped = finish(proc)
    straight_output = finish(first)
    assert first.returncode == 0, straight_output[-3000:]
    assert "checkpoint saved" in stopped, stopped[-3000:]
    checkpoint = torch.load(broken / "checkpoint.pt", weights_only=True)
    resumed = launch(data, broken, "--resume")
    output = finish(resumed)
    assert resumed.returncode == 0, output[-3000:]
    return {"straight": [trace(straight, r) for r in (0, 1)], "broken": [trace(broken, r) for r in (0, 1)],
            "keys": [k for shard in manifest.splits["train"].shards for k in shard.keys],
            "clips": read(str(straight)),
            "stopped": checkpoint, "resumed_output": output,
            "final": torch.load(broken / "checkpoint.pt", weights_only=True)}


def shape(record: dict) -> tuple:
    return record["step"], record["epoch"], record["batch"], record["frames"], record["crop"], record["lr"]


def test_every_rank_trains_the_schedules_shape_at_every_step(runs):
    r0, r1 = runs["straight"]
    sched = Schedule(plan(EPOCHS, STAGES, 8, 32), batch=1, world_size=2, samples=TRAIN)
    assert [r["step"] for r in r0] == list(range(sched.total))
    assert [shape(a) for a in r0] == [shape(b) for b in r1]
    for record in r0:
        want = sched.at(record["step"])
        assert (record["epoch"], record["batch"], record["frames"], record["crop"]) == (
            want.epoch + 1, want.batch, want.shape.frames, want.shape.crop)  # the trace counts epochs from 1
    shapes = {(r["frames"], r["crop"]) for r in r0}
    assert {(2, 16), (2, 23), (4, 32), (8, 16), (8, 32)} <= shapes  # both cycles really ran
    # the clip log (--clip-log) names each step's own clips, whatever its shape: every clip once an epoch
    batches = {(r, s["step"]): s["batch"] for r, steps in enumerate((r0, r1)) for s in steps}
    assert sorted((c["rank"], c["step"]) for c in runs["clips"]) == sorted(batches)
    assert all(len(c["keys"]) + len(c["padding"]) == batches[(c["rank"], c["step"])] for c in runs["clips"])
    for epoch in range(sched.epochs):
        assert sorted(k for c in runs["clips"] if c["epoch"] == epoch + 1
                      for k in c["keys"]) == sorted(runs["keys"])
    assert runs["final"]["epoch"] == sched.epochs


def test_ranks_are_identical_after_each_averaging_step_and_apart_between(runs):
    r0, r1 = runs["straight"]
    for a, b in zip(r0, r1):
        assert a["drifted"] == b["drifted"] == (a["step"] % 2 == 0)  # K=2: odd steps synchronise
        if a["drifted"] and a["lr"] > 0:  # (the first step, at rate 0, moves nothing)
            assert a["weights"] != b["weights"], a["step"]
        else:
            assert a["weights"] == b["weights"], a["step"]


def test_resumed_mid_schedule_on_the_same_shape_batch_rate_and_weights(runs):
    straight, stopped = runs["straight"], runs["stopped"]
    assert (stopped["step"], stopped["epoch"], stopped["batch"]) == (STOP_STEPS, STOP_EPOCH, STOP_BATCH)
    assert f"in epoch {STOP_EPOCH + 1}, after batch {STOP_BATCH} (step {STOP_STEPS}" in runs["resumed_output"]
    for rank in (0, 1):
        broken = runs["broken"][rank]
        assert [r["step"] for r in broken] == list(range(len(straight[rank])))  # no step lost or repeated
        assert shape(broken[STOP_STEPS]) == shape(straight[rank][STOP_STEPS])  # where it resumed
        assert broken == straight[rank]  # shapes, rates, losses and weights, bitwise, to the end
