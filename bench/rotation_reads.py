"""What rotating stored clips costs the loader: clips/s and bytes read, ``--stored-clips each`` against
``rotate``, side by side on one set.

A set of ``--videos`` videos with K stored clips each (``--clips``; 8 frames of 160x120 JPEG, keys
``<video>_cNN`` placed by a hash of the key as ingest places them, in shards of ``--shard-samples``) is
written once. Then, interleaved ``--repeats`` times, one epoch of ``ClipLoader`` (in-process,
``num_workers=0``, 112-pixel crops) in each mode; printed: the median clips/s of each and their ratio,
and from the epoch's plans (``trainer.data.plan``: exact, no timing) the reads and the bytes read per
clip handed out (rotation reads through the clips it does not hand out when they lie at most
``plan.READ_GAP`` apart, so it reads up to K times the bytes of the clips it decodes).

    python bench/rotation_reads.py [--videos 64] [--clips 4] [--repeats 5]
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shards.format.manifest import Manifest, SplitInfo, digest  # noqa: E402
from shards.format.ordering import shuffled  # noqa: E402
from shards.format.packing import shard_name, write_shard  # noqa: E402
from shards.format.sample import clip_key, pack  # noqa: E402
from trainer.data import ClipLoader, EpochOptions  # noqa: E402


def make_set(out: Path, videos: int, clips: int, per_shard: int) -> None:
    if (out / "manifest.json").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    keys = shuffled([clip_key(f"v{v:04d}", k) for v in range(videos) for k in range(clips)], 0)
    samples = []
    for key in keys:
        frames = []
        for _ in range(8):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (120, 160, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
            frames.append(buf.getvalue())
        label = int(key[1:5]) % 4
        samples.append((key, label, pack(key, frames, label, {"label": label})))
    shards = []
    for k, start in enumerate(range(0, len(samples), per_shard)):
        name = shard_name("train", k)
        shards.append(write_shard(str(out / name), name, samples[start:start + per_shard]))
    Manifest(classes=[f"c{c}" for c in range(4)], splits={"train": SplitInfo(shards=shards)},
             config={"clip": {"frames": 8}}, fingerprint=digest({"videos": videos,
                                                                 "clips": clips})).save(str(out))


def loader(data: Path, mode: str) -> ClipLoader:
    return ClipLoader(str(data), "train", EpochOptions(batch_size=8, seed=1, stored_clips=mode),
                      num_workers=0, crop_size=112, scale_size=120)


def epoch_rate(data: Path, mode: str) -> float:
    ld = loader(data, mode)
    start = time.perf_counter()
    clips = sum(int(b["valid"].sum()) for b in ld)
    return clips / (time.perf_counter() - start)


def plan_bytes(data: Path, mode: str) -> tuple[int, float]:
    """(reads, bytes read per clip handed out) of the first epoch's plans."""
    ld = loader(data, mode)
    plans = ld.epochs.worker_plans([str(data / s.name) for s in ld.shards])
    handed = sum(len(p.order) for p in plans)
    return sum(len(p.reads) for p in plans), sum(r.end - r.start for p in plans for r in p.reads) / handed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/kinetics-fast-bench-rotation"))
    p.add_argument("--videos", type=int, default=64)
    p.add_argument("--clips", type=int, default=4)
    p.add_argument("--shard-samples", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    data = args.work / f"v{args.videos}-k{args.clips}"
    make_set(data, args.videos, args.clips, args.shard_samples)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    rates = {"each": [], "rotate": []}
    for _ in range(args.repeats):
        for mode in rates:
            rates[mode].append(epoch_rate(data, mode))
    for mode, r in rates.items():
        reads, per_clip = plan_bytes(data, mode)
        print(f"{mode}: {statistics.median(r):.1f} clips/s (median of {len(r)}, {min(r):.1f}-{max(r):.1f}); "
              f"{reads} reads, {per_clip / 1e3:.1f} kB read a clip handed out")
    print(f"rotate / each, clips/s: "
          f"{statistics.median(rates['rotate']) / statistics.median(rates['each']):.2f} (load average at the "
          f"end: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
