"""Faults of a training job, injected for real (docs/faults.md): signals to one rank, to a process
group and to every process of a horovodrun job; resuming on another world size; checkpoints of
another run; a shard set without the validation split.

One epoch of 42 clips is trained in three pieces that hand over by checkpoint:
A. horovodrun, 2 ranks: rank 1 alone gets SIGTERM during its 2nd step;
B. 1 rank (``--resume`` from 2 ranks): SIGTERM to its process group (it and its loader worker)
   during its 3rd step;
C. horovodrun, 2 ranks (``--resume`` from 1 rank): after the epoch's training, SIGTERM to every
   process of the job (horovodrun, its helpers, the ranks, their loader workers: what Slurm's
   ``scancel`` and time limit do) while the first validation batch is scored.
``tests/helpers/faultrun.py`` sends the signals and records every rank's exit code; the trainer's
``--clip-log`` logs the clips of every step of every rank.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.shardsets import make_shardset

from shards.format.manifest import Manifest
from trainer import cli, metrics
from trainer.clip_log import read_file
from trainer.schedules import recipe

HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
FAULTRUN = str(Path(__file__).with_name("helpers") / "faultrun.py")
CLIPS, BATCH, LR_PER_8, WARMUP = 42, 4, 0.4, 0.5
FLAGS = ["--segments", "4", "--depth", "10", "--width", "8", "--crop-size", "32", "--scale-size", "36",
         "--batch-size", str(BATCH), "--epochs", "1", "--warmup-epochs", str(WARMUP),
         "--lr-per-8", str(LR_PER_8), "--workers", "1", "--print-freq", "1", "--no-tensorboard"]


def train(data, out, ranks: int, fault: str, fault_rank: int = 0, *extra) -> subprocess.CompletedProcess:
    launch = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo"] if ranks == 2 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT": fault, "FAULT_RANK": str(fault_rank),
           "EXIT_LOG": str(out / "exits")}
    return subprocess.run([*launch, sys.executable, FAULTRUN, "train", "--data", str(data), "--output-dir",
                           str(out),
                           *(["--backend", "none"] if ranks == 1 else []), *FLAGS, "--clip-log", *extra],
                          env=env, capture_output=True, text=True, timeout=300, start_new_session=True)


def ranks_output(run: subprocess.CompletedProcess) -> str:
    """What the ranks printed (horovodrun prefixes it with [rank]), without horovodrun's own lines."""
    return "".join(line for line in (run.stdout + run.stderr).splitlines(keepends=True) if line[:1] == "[")


def clip_logs(out) -> dict[str, list[dict]]:
    """Every process's ``--clip-log`` records (one per training step), by file."""
    return {path.name: read_file(str(path)) for path in (out / "clips").glob("*.jsonl")}


def exit_codes(out, rank: int) -> list[int]:
    """The codes ``rank``'s trainer returned, run after run (``tests/helpers/faultrun.py``)."""
    path = out / f"exits.rank{rank}.jsonl"
    return [json.loads(line)["exit"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Runs A, B and C; returns the data, output directory, each run and what it left."""
    tmp = tmp_path_factory.mktemp("chain")
    data, out = tmp / "data", tmp / "run"
    make_shardset(str(data), {"train": CLIPS, "val": 8}, per_shard=5, num_classes=3, frames=4, size=(48, 40))
    runs = {}
    for name, ranks, fault, fault_rank in (("A", 2, "step:2:TERM:self", 1), ("B", 1, "step:3:TERM:group", 0),
                                           ("C", 2, "validation:1:TERM:job", 0)):
        logs, codes = clip_logs(out), {r: len(exit_codes(out, r)) for r in (0, 1)}
        run = train(data, out, ranks, fault, fault_rank, *(["--resume"] if runs else []))
        steps = {r: [] for r in range(ranks)}
        for path, records in clip_logs(out).items():
            for record in records[len(logs.get(path, [])):]:  # this run's
                steps[record["rank"]].append(record)
        exits = {r: exit_codes(out, r)[codes[r]:] for r in range(ranks)}
        runs[name] = (run, torch.load(out / "checkpoint.pt", weights_only=True), steps, exits)
    return data, out, runs


def test_a_signal_to_one_rank_or_a_whole_job_stops_every_rank_at_the_same_step(chain):
    _, _, runs = chain
    (a, ckpt_a, steps_a, exits_a), (b, ckpt_b, steps_b, exits_b), (c, ckpt_c, steps_c,
                                                                   exits_c) = runs.values()
    # A: rank 1 alone was signalled; both ranks trained 2 steps and exited 143, rank 0 saved step 2
    assert [len(steps_a[r]) for r in (0, 1)] == [2, 2] and exits_a == {0: [143], 1: [143]}, a.stderr[-3000:]
    # (horovodrun's own report names the first rank out: the other may be ended by it while it exits)
    assert "exit with status code 143." in a.stdout, a.stdout[-3000:]
    assert a.returncode == 1  # horovodrun's own code whenever a rank exits non-zero
    assert (ckpt_a["epoch"], ckpt_a["step"], len(ckpt_a["rng"])) == (0, 2, 2)
    # B: the process group (rank and loader worker) got SIGTERM mid-step: saved after that step
    assert b.returncode == 143 and exits_b == {0: [143]} and "Traceback" not in b.stderr, b.stderr[-3000:]
    assert len(steps_b[0]) == 3 and ckpt_b["step"] == 5
    # C: every process of the job got SIGTERM during validation: validation abandoned, the
    # finished epoch saved (resuming validates it), every rank out with 143
    rest = -(-(CLIPS - ckpt_b["clips_seen"]) // (2 * BATCH))  # the epoch's steps left on 2 ranks
    assert [len(steps_c[r]) for r in (0, 1)] == [rest, rest]
    assert exits_c == {0: [143], 1: [143]} and "Traceback" not in ranks_output(c), c.stderr[-3000:]
    assert "stopped by signal 15 in epoch 1" in c.stderr and c.returncode == 1, c.stdout[-3000:]
    assert (ckpt_c["epoch"], ckpt_c["step"], ckpt_c["clips_seen"]) == (0, 5 + rest, CLIPS)
    assert (ckpt_c["loader"]["samples_consumed"] == rest * BATCH
            and ckpt_c["loader"]["segments"][-1]["world_size"] == 2)
    records = metrics.read(str(chain[1] / "metrics.jsonl"))
    assert not [r for r in records if r["event"] == "epoch"]  # the epoch is not over before its validation


def test_resumed_on_another_world_size_every_clip_once_and_the_rate_follows_clips_seen(chain):
    _, out, runs = chain
    steps = [s for name in "ABC" for same_step in zip(*runs[name][2].values()) for s in same_step]
    real = Counter(k for s in steps for k in s["keys"])
    assert (set(real) == {f"train_v{i // 2:04d}_c{i % 2:02d}" for i in range(CLIPS)}
            and set(real.values()) == {1})
    padding = [k for s in steps for k in s["padding"]]
    assert 0 < len(padding) < 3 * 2 * BATCH and set(padding) <= set(real)
    # the clips seen (before each step, and in each checkpoint) are the real clips the earlier steps held
    seen = 0
    for name in "ABC":
        for same_step in zip(*runs[name][2].values()):
            assert {(s["clips_seen"], s["size"]) for s in same_step} == {(seen, len(same_step))}
            seen += sum(len(s["keys"]) for s in same_step)
        assert runs[name][1]["clips_seen"] == seen
    assert seen == CLIPS
    # the learning rate is peak(global batch) x the schedule at the clips seen, whatever the world size
    records = metrics.read(str(out / "metrics.jsonl"))
    train = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == list(range(1, runs["C"][1]["step"] + 1))
    for r in train:
        ranks = 1 if r["step"] in (3, 4, 5) else 2  # B's steps
        peak = recipe.scaled_lr(LR_PER_8, BATCH * ranks)
        assert r["lr"] == pytest.approx(peak * recipe.warmup_cosine(r["clips"], WARMUP * CLIPS, CLIPS)), r


def refusal(capsys, *argv: str) -> str:
    """The message ``trainer train ARGV`` refuses with before training (in this process): its one
    line, ``trainer train: error: MESSAGE``, exit status 1."""
    capsys.readouterr()
    assert cli.main(["train", "--backend", "none", *FLAGS, *argv]) == 1
    line = capsys.readouterr().err
    assert line.startswith("trainer train: error: ") and line.count("\n") == 1, line
    return line.removeprefix("trainer train: error: ").rstrip("\n")


def test_resume_of_another_models_or_data_sets_checkpoint_is_refused_saying_what_differs(
        chain, tmp_path, capsys):
    data, out, _ = chain
    other = tmp_path / "other"
    make_shardset(str(other), {"train": 10, "val": 2}, per_shard=5, num_classes=3, frames=4, size=(48, 40))
    before = (out / "checkpoint.pt").read_bytes()
    # another set: a usage error (the command line names it), the sets named by identity and contents
    assert cli.main(["train", "--backend", "none", *FLAGS, "--data", str(other), "--output-dir", str(out),
                     "--no-shift", "--resume"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    ours, theirs = (Manifest.load(str(d)).identity[:16] for d in (data, other))
    assert line == (f"trainer train: error: --resume refused: {out / 'checkpoint.pt'} was trained on shard "
                    f"set {ours} ({CLIPS} train + 8 val clips, 4 frames), but --data is shard set {theirs} "
                    f"(10 train + 2 val clips, 4 frames) at {other}: resume with --data naming the run's "
                    "set, or start afresh (--overwrite, or another --output-dir)")
    # the run's set, another model: what differs
    message = refusal(capsys, "--data", str(data), "--output-dir", str(out), "--no-shift", "--resume")
    assert message.startswith(f"--resume refused: {out / 'checkpoint.pt'} is another run's: ")
    assert "model arch tsm in the checkpoint, tsn now" in message
    assert "width" not in message and "segments" not in message
    assert (out / "checkpoint.pt").read_bytes() == before


def test_a_shard_set_without_the_validation_split_is_one_line_before_training(tmp_path, capsys):
    data = tmp_path / "data"
    make_shardset(str(data), {"train": 10}, per_shard=5, num_classes=3, frames=4, size=(48, 40))
    message = refusal(capsys, "--data", str(data), "--output-dir", str(tmp_path / "out"))
    assert message == (f"{data}: no split 'val' (--val-split); the set has train; "
                       "--val-split '' trains without validation")
    assert not (tmp_path / "out").exists()


@pytest.mark.long  # two-rank runs resumed with changed flags: a long run's
def test_resume_with_another_optimizer_is_refused_on_every_rank_and_other_hyperparameters_apply(
        chain, tmp_path):
    """``--optimizer`` cannot change under a resumed run (its state would not fit: this crashed rank 0
    with KeyError 'step' while rank 1 waited in a broadcast); momentum and weight decay can, and
    are applied from the resumed step on and recorded (before, the checkpoint's were kept silently)."""
    data, out, _ = chain
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes((out / "checkpoint.pt").read_bytes())
    before = torch.load(run / "checkpoint.pt", weights_only=True)

    refused = train(data, run, 2, "", 0, "--resume", "--optimizer", "adam")
    assert refused.returncode == 1, refused.stderr[-3000:]
    lines = [line for line in ranks_output(refused).splitlines() if "--resume refused" in line]
    assert len(lines) == 2 and {line[:3] for line in lines} == {"[0]", "[1]"}, ranks_output(refused)
    assert lines[0].endswith("is another run's: --optimizer sgd in the checkpoint, adam now")
    assert "Traceback" not in ranks_output(refused)

    applied = train(data, run, 2, "", 0, "--resume", "--momentum", "0", "--weight-decay", "0.5", "--epochs",
                    "2")
    assert applied.returncode == 0, applied.stderr[-3000:]
    assert ("applied from here on: --epochs 1 -> 2, --momentum 0.9 -> 0.0, --weight-decay 0.0001 -> 0.5"
            in ranks_output(applied)), ranks_output(applied)
    after = torch.load(run / "checkpoint.pt", weights_only=True)
    assert after["step"] > before["step"]
    groups = after["optimizer"]["param_groups"]
    assert [g["momentum"] for g in groups] == [0.0, 0.0] and [g["weight_decay"] for g in groups] == [0.5, 0.0]
    assert (after["config"]["recipe"]["momentum"], after["config"]["recipe"]["weight_decay"]) == (0.0, 0.5)
    # SGD without momentum keeps no buffers (kept from the checkpoint, rank 1 could not match them in
    # Horovod's state broadcast: the run hung)
    assert before["optimizer"]["state"] and not after["optimizer"]["state"]
