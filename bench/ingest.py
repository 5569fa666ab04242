"""Benchmark: ingest vs. frame-folder extraction vs. the ffmpeg decode limit, side by side.

On the same generated videos, in one run:
  (a) this project's ``ingest build`` (Ray, decode once, keep 8 frames, JPEG, shards);
  (b) the common practice it replaces: every frame to a JPEG file in a folder per video
      (ffmpeg ``img_%05d.jpg``, as the TSM and mmaction2 extraction tools do), then pick 8;
  (c) the limit: ffmpeg decoding the same videos to nothing (``-f null``).
All three use the same number of parallel single-threaded workers. Each mode is repeated and
the median is reported (modes interleaved, so machine noise hits them alike); ratios a/b and
a/c are the figures to quote. Memory: peak summed RSS of the worker processes (Ray workers and
their ffmpeg children for a; ffmpeg for b and c).

    .venv/bin/python bench/ingest.py --videos 12 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from ingest import ray_runtime, sampling  # noqa: E402
from ingest.build import build  # noqa: E402
from ingest.clips import ClipConfig  # noqa: E402
from ingest.synth import synthesize  # noqa: E402


def is_ffmpeg(name: str, cmd: str) -> bool:
    return name == "ffmpeg"


def is_ffmpeg_or_ray_worker(name: str, cmd: str) -> bool:
    return name == "ffmpeg" or "ray::" in cmd or "default_worker.py" in cmd


class PeakMemory:
    """Peak of the summed RSS of the processes doing the work, sampled every 50 ms."""

    def __init__(self, counts):
        self.counts = counts
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            total = 0
            for p in psutil.process_iter(["name", "cmdline", "memory_info"]):
                cmd = " ".join(p.info["cmdline"] or [])
                if self.counts(p.info["name"], cmd):
                    total += p.info["memory_info"].rss if p.info["memory_info"] else 0
            self.peak = max(self.peak, total)
            self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_ffmpeg(args: list[str]) -> None:
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *args], check=True)


def mode_ingest(src: Path, work: Path, workers: int) -> None:
    build(str(src), str(work / "shards"), ClipConfig(), workers=workers, shard_size=256 * 10**6,
          videos_per_task=1)


def mode_frame_folders(videos: list[Path], work: Path, workers: int) -> None:
    def one(v: Path):
        d = work / "frames" / v.stem
        d.mkdir(parents=True)
        run_ffmpeg(["-threads", "1", "-i", str(v), "-threads", "1", "-vf", "scale=-2:256", "-q:v", "2",
                    str(d / "img_%05d.jpg")])
        frames = sorted(os.listdir(d))
        keep = sampling.clip_indices(len(frames), 8, train=True, seed=0, video_id=v.stem, clip=0, num_clips=1)
        return [(d / frames[i]).read_bytes() for i in keep]

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, videos))


def mode_decode_null(videos: list[Path], work: Path, workers: int) -> None:
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda v: run_ffmpeg(["-threads", "1", "-i", str(v), "-f", "null", "-"]), videos))


def measure(fn, counts, work_root: Path) -> dict:
    work = Path(tempfile.mkdtemp(dir=work_root))
    with PeakMemory(counts) as mem:
        t0 = time.perf_counter()
        fn(work)
        seconds = time.perf_counter() - t0
    shutil.rmtree(work)
    return {"seconds": seconds, "peak_rss_mb": mem.peak / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--videos", type=int, default=12, help="videos per resolution")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--sizes", default="1280x720,340x256")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--cache", default="/tmp/bench-ingest-videos", help="where generated videos are kept")
    args = p.parse_args()

    ray_runtime.start(None, args.workers)
    rows = []
    for size in args.sizes.split(","):
        w, h = map(int, size.split("x"))
        src = Path(args.cache) / f"{size}-{args.fps}fps-{args.seconds}s-{args.videos}"
        synthesize(str(src), classes=2, train_per_class=(args.videos + 1) // 2, val_per_class=0, width=w,
                   height=h, fps=args.fps, seconds=args.seconds, seed=0)
        videos = sorted(src.rglob("*.mp4"))
        root = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
        modes = [("a_ingest", lambda wk: mode_ingest(src, wk, args.workers), is_ffmpeg_or_ray_worker),
                 ("b_frame_folders", lambda wk: mode_frame_folders(videos, wk, args.workers), is_ffmpeg),
                 ("c_decode_null", lambda wk: mode_decode_null(videos, wk, args.workers), is_ffmpeg)]
        res = {}
        for _ in range(args.repeats):  # interleave the modes so machine noise hits them alike
            for name, fn, counts in modes:
                r = measure(fn, counts, root)
                res.setdefault(name, []).append(r)
        res = {k: {"seconds": statistics.median(r["seconds"] for r in v),
                   "peak_rss_mb": max(r["peak_rss_mb"] for r in v)} for k, v in res.items()}
        shutil.rmtree(root)
        for r in res.values():
            r["videos_per_s_per_core"] = len(videos) / r["seconds"] / args.workers
        row = {"size": size, "videos": len(videos), "workers": args.workers, **{
            f"{k}_{m}": round(v[m], 3) for k, v in res.items() for m in ("videos_per_s_per_core", "peak_rss_mb")},
            "a_over_b": round(res["b_frame_folders"]["seconds"] / res["a_ingest"]["seconds"], 2),
            "a_over_c": round(res["c_decode_null"]["seconds"] / res["a_ingest"]["seconds"], 2)}
        rows.append(row)
        print(f"{size}: {len(videos)} videos x {args.seconds:g}s @ {args.fps} fps, {args.workers} workers, "
              f"median of {args.repeats}")
        for k, v in res.items():
            print(f"  {k:16s} {v['videos_per_s_per_core']:7.3f} videos/s/core   peak RSS {v['peak_rss_mb']:7.0f} MB")
        print(f"  a/b = {row['a_over_b']:.2f}x   a/c = {row['a_over_c']:.2f}x")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
