"""Horovod on CPU: ranks stay identical, two ranks equal one, and the CLI runs under horovodrun.

Run as a script (``horovodrun ... python tests/test_horovod.py OUT``) this file is the worker:
it trains tiny engines on fixed batches, rank r taking its slice of each global batch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.shardsets import make_shardset

from trainer.config import Model, Recipe, System
from trainer.distributed import backends as distributed
from trainer.engine import Engine

HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
GLOBAL_BATCH, STEPS, SEGMENTS, SIZE, CLASSES = 8, 4, 4, 32, 3
# name -> (BN mode, fp16 allreduce); every variant trains in the same worker launch
VARIANTS = {"frozen_bn": ("frozen", False), "train_bn": ("train", False), "fp16_allreduce": ("frozen", True)}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def engine(backend, batch: int, lr_per_8: float, epoch_clips: int, variant=("train", False)) -> Engine:
    bn, fp16_allreduce = variant
    torch.manual_seed(backend.rank)  # different initial weights: the broadcast must fix them
    e = Engine(backend, CLASSES, epoch_clips, model=Model(segments=SEGMENTS, depth=10, width=8, bn=bn),
               recipe=Recipe(epochs=1, warmup_epochs=0, lr_per_8=lr_per_8),
               system=System(fp16_allreduce=fp16_allreduce), batch_size=batch)
    backend.broadcast_state(e.model, e.optimizer)
    e.model.train()
    return e


def worker(out: str) -> None:
    backend = distributed.init("horovod")
    data = torch.Generator().manual_seed(123)
    batches = [(torch.randint(0, 256, (GLOBAL_BATCH, SEGMENTS, 3, SIZE, SIZE), generator=data,
                              dtype=torch.uint8),
                torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=data)) for _ in range(STEPS)]
    share = GLOBAL_BATCH // backend.size
    mine = slice(backend.rank * share, (backend.rank + 1) * share)
    for name, variant in VARIANTS.items():
        e = engine(backend, share, 0.4, STEPS * GLOBAL_BATCH, variant)
        initial = {k: v.clone() for k, v in e.model.state_dict().items()}
        for clips, labels in batches:
            e.train_step(clips[mine], labels[mine])
        torch.save({"initial": initial, "final": e.model.state_dict()},
                   os.path.join(out, f"{name}-size{backend.size}-rank{backend.rank}.pt"))
    # padding: the last 2 clips of each global batch only repeat its first 2 (valid False), all on
    # the last of two ranks; one rank trains on the 6 real clips alone, at the same peak rate
    real = GLOBAL_BATCH - 2
    two = backend.size > 1
    e = engine(backend, share if two else real, 0.4 * GLOBAL_BATCH / (GLOBAL_BATCH if two else real),
               STEPS * real, VARIANTS["frozen_bn"])
    valid = torch.arange(GLOBAL_BATCH) < real
    for clips, labels in batches:
        clips, labels = torch.cat([clips[:real], clips[:2]]), torch.cat([labels[:real], labels[:2]])
        if two:
            e.train_step(clips[mine], labels[mine], valid[mine], real)
        else:
            e.train_step(clips[:real], labels[:real])
    torch.save({"final": e.model.state_dict()},
               os.path.join(out, f"padding-size{backend.size}-rank{backend.rank}.pt"))
    backend.shutdown()


def run_workers(tmp_path: Path) -> dict:
    hvd = subprocess.run([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, __file__,
                          str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=300)
    assert hvd.returncode == 0, hvd.stdout[-3000:] + hvd.stderr[-3000:]
    one = subprocess.run([sys.executable, __file__, str(tmp_path)], env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    return {p.stem: torch.load(p) for p in tmp_path.glob("*.pt")}


def params(model_state: dict) -> dict:
    """Only the learned tensors (BN running statistics are per-rank by design)."""
    return {k: v for k, v in model_state.items() if "running" not in k and "num_batches" not in k}


def test_two_ranks_stay_identical_and_equal_one_rank_with_the_same_global_batch(tmp_path):
    runs = run_workers(tmp_path)
    for name in VARIANTS:
        r0, r1 = runs[f"{name}-size2-rank0"], runs[f"{name}-size2-rank1"]
        for key, value in r0["initial"].items():  # rank 0's initial weights reached rank 1
            assert torch.equal(value, r1["initial"][key]), (name, key)
        for key, value in params(r0["final"]).items():  # same averaged gradients, same steps
            assert torch.equal(value, r1["final"][key]), (name, key)
    # with frozen BN a rank's forward pass does not depend on the other rank's clips, so two
    # ranks of 4 clips compute exactly the gradient of one rank of 8, up to summation order
    two, one = runs["frozen_bn-size2-rank0"], runs["frozen_bn-size1-rank0"]
    assert all(torch.equal(v, one["initial"][k]) for k, v in two["initial"].items())
    moved = max((one["final"][k] - one["initial"][k]).abs().max().item() for k in params(one["final"]))
    assert moved > 1e-2
    for key, value in params(two["final"]).items():
        assert torch.allclose(value, one["final"][key], rtol=1e-4, atol=1e-6), key
    # fp16 gradient compression rounds each allreduce: the weights move as in full precision
    # to within a few percent of how far they moved, but not identically
    fp16 = runs["fp16_allreduce-size2-rank0"]
    deviations = []
    for key, value in params(fp16["final"]).items():
        deviation = (value - two["final"][key]).abs().max().item()
        assert deviation <= 0.05 * (two["final"][key] - two["initial"][key]).abs().max().item(), key
        deviations.append(deviation)
    assert max(deviations) > 0
    # repeats that only pad weigh nothing: the same step as on the real clips alone
    padded, alone = runs["padding-size2-rank0"]["final"], runs["padding-size1-rank0"]["final"]
    for key, value in params(padded).items():
        assert torch.allclose(value, alone[key], rtol=1e-4, atol=1e-6), key


def test_horovodrun_trains_and_tests_from_the_command_line(tmp_path):
    data, out = tmp_path / "data", tmp_path / "run"
    make_shardset(str(data), {"train": 16, "val": 7}, per_shard=4, num_classes=3, frames=4, size=(48, 40))
    hvd = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "trainer"]
    train = subprocess.run(hvd + [
        "train", "--data", str(data), "--output-dir", str(out), "--segments", "4", "--depth", "10", "--width",
        "8",
        "--crop-size", "32", "--scale-size", "36", "--batch-size", "2", "--epochs", "2", "--warmup-epochs",
        "1",
        "--workers", "1", "--print-freq", "1", "--no-tensorboard"], env=ENV, capture_output=True, text=True,
        timeout=300)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert all(r["val_samples"] == 7 for r in epochs)  # 8 evaluated over 2 ranks, 1 of them padding
    assert max(r["step"] for r in records if r["event"] == "train") == 2 * 4  # 16 clips / (2 x 2) per epoch
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["step"], len(ckpt["rng"])) == (2, 8, 2)

    # on two ranks, the run fused with itself (--fuse scores each run as --checkpoint does): each
    # stream and the fusion score as the run alone on one rank
    results = []
    one_rank = [sys.executable, "-m", "trainer"]
    for name, launcher, runs in (("two", hvd, ["--fuse", str(out), str(out), "--weights", "1", "3"]),
                                 ("one", one_rank, ["--checkpoint", str(out / "checkpoint.pt")])):
        report = tmp_path / f"test-{name}.json"
        test = subprocess.run(launcher + [
            "test", *runs, "--data", str(data), "--crops", "3", "--batch-size", "2", "--workers", "0",
            "--output", str(report)], env=ENV, capture_output=True, text=True, timeout=300)
        assert test.returncode == 0, test.stdout[-3000:] + test.stderr[-3000:]
        results.append(json.loads(report.read_text()))
    fused, alone = results
    one = alone["summary"]
    for two in fused["summary"]["streams"]:
        # 7 val clips of 4 videos (two clips each, the last one clip) whichever the rank count
        assert two["videos"] == one["videos"] == 4
        assert two["views_per_video"] == one["views_per_video"] == 7 / 4
        for key in ("video_top1", "video_top5", "clip_top1"):
            assert abs(two[key] - one[key]) < 1e-6, key
    for stream in fused["streams"]:
        assert stream["videos"].keys() == alone["videos"].keys()
        for video, entry in stream["videos"].items():
            assert entry["scores"] == pytest.approx(alone["videos"][video]["scores"], abs=1e-4), video
    assert abs(fused["summary"]["video_top1"] - one["video_top1"]) < 1e-6
    assert set(fused["videos"]) == {f"val_v{i:04d}" for i in range(4)}


if __name__ == "__main__":
    worker(sys.argv[1])
