"""What pre-sampled clips cost in accuracy: stored clips (K of them, rotating or as separate samples)
against a new TSN sampling every epoch, on a task where the frames chosen matter.

The task: ``ingest synth`` videos (classes differ only in how a textured disc moves over a textured
background; ``--seconds`` long, so T frames are a small part of each video) at a slow ``--speed-scale``
so the motion survives frames a segment apart. Every video is decoded once into memory (PyAV, scaled to
``--size`` pixels high); each arm then cuts its clips from those frames with ingest's own TSN sampler
(``ingest.sampling.clip_indices``: T segments, a random frame in each, seeded by seed, video and clip
index), so an arm differs from another only in which samplings it trains on:

* ``resample``: a new sampling of every video each epoch (clip index = the epoch), the per-epoch
  resampling of TSN/TSM's own loaders, here the baseline (decoding on the fly is ~26x slower than
  reading stored clips, BENCHMARKS.md; the accuracy it buys is what this measures);
* ``rotate-K``: K stored samplings a video (clip 0..K-1, as ``ingest build --clips-per-video K``), epoch
  e training on clip e mod K (``--stored-clips rotate``, trainer/data/rotation.py);
* ``each-4``: 4 stored samplings as 4 samples an epoch (``--stored-clips each``, today's default), so
  a quarter of the epochs for the same optimizer steps.

Every arm takes the same optimizer steps (``--epochs`` epochs of one view a video, ``each-4``
``--epochs`` / 4 of four), and seed s gives every arm the same initial weights, batch order draws
and stored samplings (paired by seed). The network is tiny (three convolutions with TSM's temporal
shift, time-averaged, ~20k weights, Adam) so that it runs on 2 cores; validation: one centre clip a video
(ingest's evaluation sampling). Printed: each arm's final validation top-1 per seed, its mean, and
per arm its difference from ``resample`` paired by seed with a 95% t-interval (bench/paired.py's).

    python bench/presampling.py --work /tmp/presampling [--seeds 5] [--epochs 240]
"""
from __future__ import annotations

import argparse
import json
import math
import os
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.paired import t975  # noqa: E402
from ingest.sampling import clip_indices  # noqa: E402

ARMS = ("resample", "rotate-1", "rotate-2", "rotate-4", "rotate-8", "each-4")


def videos(work: Path, args) -> dict[str, list[tuple[np.ndarray, int, str]]]:
    """Each split's videos as (frames uint8 (N, H, W, 3), class, video id), made by ``ingest synth`` once."""
    src = work / "videos"
    if not src.exists():
        subprocess.run([sys.executable, "-m", "ingest", "synth", "--out", str(src), "--classes",
                        str(args.classes),
                        "--train-per-class", str(args.train_per_class), "--val-per-class",
                        str(args.val_per_class),
                        "--seconds", str(args.seconds), "--speed-scale", str(args.speed_scale), "--workers",
                        "1"],
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


class Tiny(nn.Module):
    """Three convolutions over each frame, a temporal shift (TSM's: a quarter of the channels one frame
    back, a quarter forward) before the last two, averaged over time."""

    def __init__(self, classes: int, width: int = 16):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(3, width, 3, padding=1), nn.Conv2d(width, 2 * width, 3, 2, 1),
                                    nn.Conv2d(2 * width, 2 * width, 3, 2, 1)])
        self.fc = nn.Linear(2 * width, classes)

    @staticmethod
    def shift(x: torch.Tensor, t: int) -> torch.Tensor:
        bt, c, h, w = x.shape
        x = x.view(bt // t, t, c, h, w)
        q = c // 4
        out = torch.zeros_like(x)
        out[:, 1:, :q] = x[:, :-1, :q]
        out[:, :-1, q:2 * q] = x[:, 1:, q:2 * q]
        out[:, :, 2 * q:] = x[:, :, 2 * q:]
        return out.view(bt, c, h, w)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:  # (B, T, H, W, 3) uint8
        b, t = clips.shape[:2]
        x = clips.flatten(0, 1).permute(0, 3, 1, 2).float() / 127.5 - 1
        for i, conv in enumerate(self.convs):
            x = F.relu(conv(self.shift(x, t) if i else x))
        return self.fc(x.mean(dim=(2, 3)).view(b, t, -1).mean(dim=1))


def clip(frames: np.ndarray, video: str, k: int, segments: int, seed: int, train: bool) -> np.ndarray:
    idx = clip_indices(len(frames), segments, train=train, seed=seed, video_id=video, clip=k, num_clips=1)
    return frames[idx]


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
    model = Tiny(args.classes)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    rng = np.random.default_rng(seed)
    epochs = args.epochs // 4 if arm == "each-4" else args.epochs
    for epoch in range(epochs):
        samples = [(v, k) for v in range(len(data["train"])) for k in epoch_views(arm, epoch)]
        order = rng.permutation(len(samples))
        for start in range(0, len(order), args.batch):
            picked = [samples[i] for i in order[start:start + args.batch]]
            x = torch.from_numpy(np.stack([clip(data["train"][v][0], data["train"][v][2], k, args.segments,
                                                seed, True)
                                           for v, k in picked]))
            y = torch.tensor([data["train"][v][1] for v, _ in picked])
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        x = torch.from_numpy(np.stack([clip(f, v, 0, args.segments, seed, False) for f, _, v in data["val"]]))
        y = torch.tensor([label for _, label, _ in data["val"]])
        return 100.0 * float((model(x).argmax(1) == y).float().mean())


def interval(diffs: list[float]) -> str:
    mean = statistics.mean(diffs)
    half = t975(len(diffs)
                - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    return f"{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=240, help="epochs of one view a video (a multiple of 4)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--train-per-class", type=int, default=8)
    p.add_argument("--val-per-class", type=int, default=25)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--speed-scale", type=float, default=0.25)
    p.add_argument("--size", type=int, default=24, help="frame height after scaling, pixels")
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    data = videos(args.work, args)
    print(f"{len(data['train'])} training and {len(data['val'])} validation videos of "
          f"{len(data['train'][0][0])} frames, {args.segments} segments; {args.epochs} epochs of one view a "
          f"video; decoded in {time.perf_counter() - start:.0f} s", flush=True)
    top1 = {arm: [] for arm in args.arms}
    for seed in range(args.seeds):
        for arm in args.arms:
            top1[arm].append(train(arm, seed, data, args))
        print(f"seed {seed}: " + ", ".join(f"{arm} {top1[arm][-1]:.1f}" for arm in args.arms), flush=True)
    print("\narm | final val top-1 per seed | mean | - resample, paired by seed: mean [95% interval]")
    for arm in args.arms:
        paired = (interval([a - b for a, b in zip(top1[arm], top1["resample"])])
                  if "resample" in top1 and arm != "resample" else "")
        print(f"{arm} | {', '.join(f'{v:.1f}' for v in top1[arm])} | {statistics.mean(top1[arm]):.1f} | "
              f"{paired}")
    print(f"\n{time.perf_counter() - start:.0f} s")
    print("BENCH_JSON " + json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "top1": top1}))


if __name__ == "__main__":
    main()
