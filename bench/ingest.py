"""Benchmark: ingest vs. frame-folder extraction vs. the ffmpeg decode limit, side by side.

On the same generated videos, in one run:
  (a) this project's ``ingest build`` (Ray, decode once, keep 8 frames, JPEG, shards);
  (r) the same with ``--decode refs``: reference frames only, the others never decoded;
  (b) the common practice it replaces: every frame to a JPEG file in a folder per video, with
      TSM's own extraction command (``ffmpeg -threads 1 -vf scale=-1:331 -q:v 0 img_%05d.jpg``,
      mmaction2's ffmpeg/OpenCV tools do the same per frame), then list the folder and pick 8;
  (b256) the same extraction at this project's output size and a common quality (short side
      256, ``-q:v 2``), the most favourable version of (b);
  (c) the limit: ffmpeg decoding the same videos to nothing (``-f null``).
All use the same number of parallel single-threaded workers. Each mode is repeated and the
median is reported (modes interleaved, so machine noise hits them alike); the ratios are the
figures to quote. Memory: peak summed RSS of the worker processes (Ray workers and their
ffmpeg children for a and r; ffmpeg for the others).

    .venv/bin/python bench/ingest.py --videos 32 --repeats 3
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


def mode_ingest(src: Path, work: Path, workers: int, decode: str) -> None:
    build(str(src), str(work / "shards"), ClipConfig(decode=decode), workers=workers, shard_size=256 * 10**6)


def mode_frame_folders(videos: list[Path], work: Path, workers: int, short_side: int, quality: int) -> None:
    def one(v: Path):
        d = work / "frames" / v.stem
        d.mkdir(parents=True)
        run_ffmpeg(["-threads", "1", "-i", str(v), "-threads", "1", "-vf", f"scale=-2:{short_side}",
                    "-q:v", str(quality), str(d / "img_%05d.jpg")])
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
    p.add_argument("--videos", type=int, default=32, help="videos per resolution (a build's fixed costs, "
                   "Ray tasks and the shard packing, are amortised over them as over a real dataset)")
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
        modes = [("a_ingest", lambda wk: mode_ingest(src, wk, args.workers, "all"), is_ffmpeg_or_ray_worker),
                 ("r_ingest_refs", lambda wk: mode_ingest(src, wk, args.workers, "refs"), is_ffmpeg_or_ray_worker),
                 ("b_frame_folders", lambda wk: mode_frame_folders(videos, wk, args.workers, 331, 0), is_ffmpeg),
                 ("b256_frame_folders", lambda wk: mode_frame_folders(videos, wk, args.workers, 256, 2), is_ffmpeg),
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
        speed = {k: 1 / v["seconds"] for k, v in res.items()}
        ratios = {f"{x}/{y}": round(speed[f"{x}_{a}"] / speed[f"{y}_{b}"], 2)
                  for x, a in (("a", "ingest"), ("r", "ingest_refs"))
                  for y, b in (("b", "frame_folders"), ("b256", "frame_folders"), ("c", "decode_null"))}
        row = {"size": size, "videos": len(videos), "workers": args.workers, **{
            f"{k}_{m}": round(v[m], 3) for k, v in res.items() for m in ("videos_per_s_per_core", "peak_rss_mb")},
            "ratios": ratios}
        rows.append(row)
        print(f"{size}: {len(videos)} videos x {args.seconds:g}s @ {args.fps} fps, {args.workers} workers, "
              f"median of {args.repeats}")
        for k, v in res.items():
            print(f"  {k:20s} {v['videos_per_s_per_core']:7.3f} videos/s/core   peak RSS {v['peak_rss_mb']:7.0f} MB")
        print("  " + "   ".join(f"{k} = {v:.2f}x" for k, v in ratios.items()))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
