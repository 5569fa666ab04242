"""What pre-sampled clips cost in accuracy: stored clips (K of them, rotating or as separate samples)
against a new TSN sampling every epoch, on a task where the frames chosen matter.

The task: ``ingest synth`` videos (classes differ only in how a textured disc moves over a textured
background; ``--seconds`` long, so T frames are a small part of each video: 4 of 40 at the defaults) at
``--speed-scale`` 0.5, so that frames a segment apart show the disc a few pixels on, as in the motion
demo (scripts/demo.sh). Every video is decoded once into memory (PyAV, scaled to ``--size`` pixels
high); each arm then cuts its clips from those frames with ingest's own TSN sampler
(``ingest.sampling.clip_indices``: T segments, a random frame in each, seeded by seed, video and clip
index), and every clip read for training is cropped as the loader crops it (TSM's multi-scale crop, a new
box each read, resized back to ``--size``; no flip, which would swap left and right), so an arm differs from
another only in which samplings it trains on:

* ``resample``: a new sampling of every video each epoch (clip index = the epoch), the per-epoch
  resampling of TSN/TSM's own loaders, here the baseline (decoding on the fly is ~26x slower than
  reading stored clips, BENCHMARKS.md; the accuracy it buys is what this measures);
* ``rotate-K``: K stored samplings a video (clip 0..K-1, as ``ingest build --clips-per-video K``), epoch
  e training on clip e mod K (``--stored-clips rotate``, trainer/data/rotation.py);
* ``each-4``: 4 stored samplings as 4 samples an epoch (``--stored-clips each``, today's default), so
  a quarter of the epochs for the same optimizer steps.

Every arm takes the same optimizer steps (``--epochs`` epochs of one view a video, ``each-4``
``--epochs`` / 4 of four), and seed s gives every arm the same initial weights, batch order draws
and stored samplings (paired by seed). The network is the trainer's TSM ResNet (``trainer.model.tsm``,
the demo's ResNet-10 of width 16), trained from scratch with SGD (momentum 0.9, a linear warm-up over
1/16 of the steps, then cosine), one thread; validation: one centre clip a video
(ingest's evaluation sampling). Printed: each arm's final validation top-1 per seed, its mean, and
per arm its difference from ``resample`` paired by seed with a 95% t-interval (bench/paired.py's).

    python bench/presampling.py --work /tmp/presampling [--seeds 10] [--first-seed 0] [--epochs 192]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.paired import summary  # noqa: E402
from ingest.sampling import clip_indices  # noqa: E402
from trainer.data.transforms import multiscale_box  # noqa: E402
from trainer.model.tsm import ModelConfig, build  # noqa: E402

ARMS = ("resample", "rotate-1", "rotate-2", "rotate-4", "each-4", "rotate-8")


def videos(work: Path, args) -> dict[str, list[tuple[np.ndarray, int, str]]]:
    """Each split's videos as (frames uint8 (N, H, W, 3), class, video id), made by ``ingest synth`` once."""
    src = work / "videos"
    if not src.exists():
        subprocess.run([sys.executable, "-m", "ingest", "synth", "--out", str(src),
                        "--classes", str(args.classes), "--train-per-class", str(args.train_per_class),
                        "--val-per-class", str(args.val_per_class), "--seconds", str(args.seconds),
                        "--width", str(args.source_size), "--height", str(args.source_size),
                        "--speed-scale", str(args.speed_scale), "--workers", "1"],
                       check=True, env={**os.environ,
                                        "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    out = {}
    for split in ("train", "val"):
        classes = sorted(p.name for p in (src / split).iterdir())
        out[split] = []
        for label, name in enumerate(classes):
            for path in sorted((src / split / name).glob("*.mp4")):
                with av.open(str(path)) as c:
                    frames = [f.to_image() for f in c.decode(video=0)]
                width = round(frames[0].width * args.size / frames[0].height)
                out[split].append((np.stack([np.asarray(f.resize((width, args.size), Image.BILINEAR))
                                             for f in frames]),
                                   label, f"{name}/{path.stem}"))
    return out


def clip(frames: np.ndarray, video: str, k: int, segments: int, seed: int, train: bool) -> np.ndarray:
    idx = clip_indices(len(frames), segments, train=train, seed=seed, video_id=video, clip=k, num_clips=1)
    return frames[idx].transpose(0, 3, 1, 2)  # (T, 3, H, W), as the network takes it


def crop(frames: np.ndarray, rng: random.Random) -> torch.Tensor:
    """The loader's training crop, drawn anew each time a clip is read whatever the arm (the product
    crops stored clips at read time): TSM's multi-scale box (``multiscale_box``), resized back to the
    frame's side; no flip (a flip would turn a left-moving disc into a right-moving one)."""
    side = frames.shape[-1]
    x0, y0, x1, y1 = multiscale_box(side, frames.shape[-2], side, rng)
    box = torch.from_numpy(np.ascontiguousarray(frames[:, :, y0:y1, x0:x1])).float()
    return F.interpolate(box, size=(side, side), mode="bilinear", align_corners=False)


def epoch_views(arm: str, epoch: int) -> list[int]:
    """The clip indices each video is trained on in ``epoch`` (one, or four for ``each-4``)."""
    if arm == "resample":
        return [epoch]
    if arm == "each-4":
        return [0, 1, 2, 3]
    return [epoch % int(arm.split("-")[1])]


def train(arm: str, seed: int, data, args) -> float:
    """Final validation top-1 (%) of ``arm`` at ``seed``."""
    torch.manual_seed(seed)
    model = build(ModelConfig(num_classes=args.classes, segments=args.segments, depth=args.depth,
                              width=args.width))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    rng, draws = np.random.default_rng(seed), random.Random(seed)
    epochs = args.epochs // 4 if arm == "each-4" else args.epochs
    steps = args.epochs * math.ceil(len(data["train"]) / args.batch)  # equal in every arm
    warmup = max(1, steps // 16)  # linear warm-up, then cosine to 0 (the trainer's recipe, per step)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: (i + 1) / warmup if i < warmup else 0.5
        * (1 + math.cos(math.pi * (i - warmup) / (steps - warmup))))
    model.train()
    for epoch in range(epochs):
        samples = [(v, k) for v in range(len(data["train"])) for k in epoch_views(arm, epoch)]
        order = rng.permutation(len(samples))
        for start in range(0, len(order), args.batch):
            picked = [samples[i] for i in order[start:start + args.batch]]
            frames = [clip(data["train"][v][0], data["train"][v][2], k, args.segments, seed, True)
                      for v, k in picked]
            x = torch.stack([crop(f, draws) for f in frames])
            y = torch.tensor([data["train"][v][1] for v, _ in picked])
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    with torch.no_grad():
        x = torch.from_numpy(np.stack([clip(f, v, 0, args.segments, seed, False) for f, _, v in data["val"]]))
        y = torch.tensor([label for _, label, _ in data["val"]])
        return 100.0 * float((model(x).argmax(1) == y).float().mean())


COLLAPSED = 80.0  # a run under this top-1 (%) is counted as one that did not learn the motion well


def report(top1: dict[str, dict[int, float]]) -> str:
    """The table: each arm's top-1 by seed, mean, median, runs under ``COLLAPSED``, and its difference
    from ``resample`` paired by seed (mean, 95% t-interval, signs: bench/paired.py's ``summary``)."""
    lines = ["| arm | seeds | mean | median | runs under 80% | - resample, paired: mean [95% interval] "
             "| higher/equal/lower (sign test p) |", "|---|---|---|---|---|---|---|"]
    base = top1.get("resample", {})
    for arm, by_seed in top1.items():
        values = list(by_seed.values())
        mean, median = statistics.fmean(values), statistics.median(values)
        row = f"| {arm} | {len(values)} | {mean:.1f} | {median:.1f} | {sum(v < COLLAPSED for v in values)} |"
        seeds = sorted(set(by_seed) & set(base))
        if arm != "resample" and len(seeds) > 1:
            s = summary([by_seed[k] - base[k] for k in seeds])
            row += (f" {s['mean']:+.1f} [{s['low']:+.1f}, {s['high']:+.1f}] | {s['higher']}/{s['equal']}/"
                    f"{s['lower']} ({s['sign_p']:.2f}) |")
        else:
            row += " | |"
        lines.append(row)
    lines.append("")
    for arm, by_seed in top1.items():
        lines.append(f"{arm} by seed: " + " ".join(f"{k}:{v:g}" for k, v in sorted(by_seed.items())))
    return "\n".join(lines)


def merged(logs: list[Path]) -> dict[str, dict[int, float]]:
    """The ``BENCH_JSON`` results of several runs (``--first-seed`` splits), by arm and seed."""
    top1: dict[str, dict[int, float]] = {}
    for log in logs:
        for line in log.read_text().splitlines():
            if line.startswith("BENCH_JSON "):
                run = json.loads(line[len("BENCH_JSON "):])
                first = int(run["args"]["first_seed"])
                for arm, values in run["top1"].items():
                    top1.setdefault(arm, {}).update({first + i: v for i, v in enumerate(values)})
    return top1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/presampling"))
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed .. first-seed + seeds - 1")
    p.add_argument("--epochs", type=int, default=192, help="epochs of one view a video (a multiple of 4)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--train-per-class", type=int, default=32)
    p.add_argument("--val-per-class", type=int, default=50)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--speed-scale", type=float, default=0.5)
    p.add_argument("--source-size", type=int, default=64, help="the synth videos' width and height, pixels")
    p.add_argument("--size", type=int, default=32, help="frame height after scaling, pixels")
    p.add_argument("--depth", type=int, default=10, help="the TSM ResNet's depth")
    p.add_argument("--width", type=int, default=16, help="the TSM ResNet's width")
    p.add_argument("--segments", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--merge", nargs="+", type=Path, metavar="LOG",
                   help="print the table of these runs' output (their BENCH_JSON lines) instead of running")
    args = p.parse_args()
    if args.merge:
        print(report(merged(args.merge)))
        return
    torch.set_num_threads(1)
    start = time.perf_counter()
    data = videos(args.work, args)
    print(f"{len(data['train'])} training and {len(data['val'])} validation videos of "
          f"{len(data['train'][0][0])} frames, {args.segments} segments; {args.epochs} epochs of one view a "
          f"video; decoded in {time.perf_counter() - start:.0f} s", flush=True)
    top1 = {arm: [] for arm in args.arms}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for arm in args.arms:
            top1[arm].append(train(arm, seed, data, args))
            print(f"  seed {seed} {arm}: {top1[arm][-1]:.1f} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
        print(f"seed {seed}: " + ", ".join(f"{arm} {top1[arm][-1]:.1f}" for arm in args.arms), flush=True)
    print("\n" + report({arm: dict(enumerate(values, args.first_seed)) for arm, values in top1.items()}))
    print(f"\n{time.perf_counter() - start:.0f} s")
    print("BENCH_JSON " + json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "top1": top1}))


if __name__ == "__main__":
    main()
