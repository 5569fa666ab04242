"""Loader benchmark: this loader on shards vs frame folders vs decoding mp4 on the fly, against
the JPEG decode limit.

All loaders read the same clips (8 frames at TSM's segment centres, short side 256) and apply
the same TSM training transform; each runs its epochs in its own process with one DataLoader
worker, so clips/s is per loader worker; per core divides the clips by the CPU time of the
worker and the trainer's process together. This loader runs twice: decoding only each clip's
crop (the default, ``trainer.data.cropdecode``) and decoding whole frames with the same
libjpeg-turbo call (what it does without crop decoding). The clips' frames are JPEG-encoded by
ingest's encoder (``ingest.jpeg``, quality 90) twice: without restart markers (shards, frame
folders, the limit) and with one every MCU (``--restart-interval 1``, ingest's default: a
second set of shards), so that crop decoding can skip the data around the crop.

The full-decode limit: the same JPEG bytes (without restart markers) held in memory decoded
whole into reused memory by the fastest of pillow-simd, simplejpeg, PyTurboJPEG and
libjpeg-turbo called directly (``cropdecode`` on the whole frame), one process, no I/O, no
transform, no batching; each decoder's rate is printed, and so is the encoding rate of
ingest's encoder with and without restart markers. File opens, stats and directory listings are counted for
real with ``strace -f`` between two marker syscalls around the epoch. Also printed: the shuffle quality
of the partition plan against a random permutation, and ``shards plan`` figures for
Kinetics-400 at 1,536 and 6,144 ranks.

    python bench/loader.py                    # synthetic videos made with ffmpeg
    python bench/loader.py --videos-dir DIR   # your own mp4 files instead
    python bench/loader.py --skip mp4 frames  # this loader and the limits only

The last line of output is ``BENCH_JSON {...}`` with every figure.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from helpers import syscalls  # noqa: E402  (the suite's strace runner and parser)

from shards.format.manifest import Manifest, SplitInfo, digest  # noqa: E402
from shards.format.ordering import shuffled  # noqa: E402
from shards.format.packing import shard_name, write_shard  # noqa: E402
from shards.format.tar import sample_bytes, sanitize_key  # noqa: E402
from shards.plan import layout, partition  # noqa: E402

T, SHORT_SIDE, CLASSES = 8, 256, 10
QUALITY, RESTART = 90, 1  # ingest's defaults


# --- data: videos, frame folders and shards of the same clips -------------------------------
def ffprobe_frames(path: str) -> int:
    out = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-count_packets",
                          "-show_entries", "stream=nb_read_packets", "-of", "csv=p=0", path],
                         check=True, capture_output=True, text=True).stdout
    return int(out.strip())


def segment_centres(num_frames: int) -> list[int]:
    """TSM's test-time sampling: the centre frame of each of T equal segments (0-based)."""
    seg = num_frames / T
    return [int(seg * (i + 0.5)) for i in range(T)]


def synth_video(path: str, seconds: float, seed: int) -> None:
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i",
                    f"testsrc2=size=640x360:rate=25:duration={seconds}",
                    "-vf", f"noise=alls=10:allf=t+u:all_seed={seed}", "-c:v", "libx264",
                    "-preset", "veryfast", "-crf", "23", "-pix_fmt", "yuv420p", path], check=True)


def extract_frames(video: str, folder: str) -> None:
    """All frames as TSM-style img_00001.jpg ... at short side 256."""
    os.makedirs(folder, exist_ok=True)
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-i", video, "-vf", f"scale=-2:{SHORT_SIDE}", "-q:v", "3",
                    "-start_number", "1", os.path.join(folder, "img_%05d.jpg")], check=True)


def write_shards(sdir: str, rows: list[dict], clips: list[list[bytes]]) -> float:
    """The clips as one split of 16-clip shards in ``sdir``; returns the mean bytes per clip."""
    samples = []
    for r, frames in zip(rows, clips):
        members = [(f"{t:02d}.jpg", jpeg) for t, jpeg in enumerate(frames)]
        members += [("cls", str(r["label"]).encode()),
                    ("json", json.dumps({"frame_indices": segment_centres(r["frames"])}).encode())]
        samples.append((f"{r['id']}_c00", r["label"], sample_bytes(f"{r['id']}_c00", members)))
    by_key = {s[0]: s for s in samples}
    samples = [by_key[k] for k in shuffled(by_key, 0)]  # stored order as ingest writes it
    per_shard = 16
    shards = [write_shard(os.path.join(sdir, shard_name("train", j)), shard_name("train", j),
                          samples[a:a + per_shard]) for j, a in enumerate(range(0, len(samples), per_shard))]
    Manifest(classes=[f"class{c}" for c in range(CLASSES)], splits={"train": SplitInfo(shards)},
             config={"clip": {"frames": T}}, fingerprint=digest([r["id"] for r in rows])).save(sdir)
    return sum(s.bytes for s in shards) / len(rows)


def prepare(out: str, videos_dir: str | None, count: int, seconds: float) -> dict:
    """Videos, frame folders, and shards without and with restart markers under ``out``;
    reused when present. The frames kept (segment centres) are re-encoded by ingest's encoder,
    and the frame folders hold the same bytes as the shards without markers."""
    from PIL import Image

    from ingest import jpeg
    info_path = os.path.join(out, "dataset-ingest-jpeg.json")
    if os.path.exists(info_path):
        return json.load(open(info_path))
    vdir = videos_dir or os.path.join(out, "videos")
    os.makedirs(vdir, exist_ok=True)
    if not videos_dir:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda i: os.path.exists(path := os.path.join(vdir, f"video{i:04d}.mp4"))
                          or synth_video(path, seconds, i), range(count)))
    videos = sorted(f for f in os.listdir(vdir) if f.endswith(".mp4"))[:count]
    rows, plain, marked = [], [], []
    for i, name in enumerate(videos):
        vid = sanitize_key(name[:-4])
        folder = os.path.join(out, "frames", vid)
        shutil.rmtree(folder, ignore_errors=True)
        extract_frames(os.path.join(vdir, name), folder)
        r = {"video": os.path.join(vdir, name), "folder": folder, "id": vid, "label": i % CLASSES,
             "frames": len(os.listdir(folder))}
        images = [Image.open(os.path.join(folder, f"img_{p + 1:05d}.jpg")).convert("RGB")
                  for p in segment_centres(r["frames"])]
        plain.append([jpeg.encode(im, QUALITY, 0) for im in images])
        marked.append([jpeg.encode(im, QUALITY, RESTART) for im in images])
        for p, data in zip(segment_centres(r["frames"]), plain[-1]):
            with open(os.path.join(folder, f"img_{p + 1:05d}.jpg"), "wb") as f:
                f.write(data)
        rows.append(r)
    with open(os.path.join(out, "clips.pickle"), "wb") as f:
        pickle.dump({"plain": plain, "restart": marked}, f)
    info = {"rows": rows, "clips": len(rows), "quality": QUALITY, "restart_interval": RESTART,
            "shards": os.path.join(out, "shards"), "shards_rst": os.path.join(out, "shards-rst")}
    info["clip_bytes"] = write_shards(info["shards"], rows, plain)
    info["clip_bytes_rst"] = write_shards(info["shards_rst"], rows, marked)
    info["frame_bytes"] = float(np.mean([len(b) for c in plain for b in c]))
    info["frame_bytes_rst"] = float(np.mean([len(b) for c in marked for b in c]))
    json.dump(info, open(info_path, "w"))
    return info


def clip_bytes(info: dict, restart: bool) -> list[list[bytes]]:
    with open(os.path.join(os.path.dirname(info["shards"]), "clips.pickle"), "rb") as f:
        return pickle.load(f)["restart" if restart else "plain"]


# --- the loaders, each run in its own process by --role -------------------------------------
class _Rows:
    """A map-style dataset over the rows of the bench's video table, each made a clip by ``transform``."""

    def __init__(self, rows, transform):
        self.rows, self.transform = rows, transform

    def __len__(self):
        return len(self.rows)


class FrameFolders(_Rows):
    """The TSM dataset's way: check the first frame exists, open one JPEG file per frame."""

    def __getitem__(self, i):
        from PIL import Image
        r = self.rows[i]
        if not os.path.exists(os.path.join(r["folder"], "img_00001.jpg")):
            raise FileNotFoundError(r["folder"])
        frames = [Image.open(os.path.join(r["folder"], f"img_{p + 1:05d}.jpg")).convert("RGB")
                  for p in segment_centres(r["frames"])]
        return self.transform.apply(frames, random.Random(i)), r["label"]


class VideoFiles(_Rows):
    """Decode the mp4 on the fly with ffmpeg, keeping the 8 segment-centre frames."""

    def __getitem__(self, i):
        import ffmpeg
        from PIL import Image
        r = self.rows[i]
        picks = segment_centres(r["frames"])
        select = "+".join(f"eq(n,{p})" for p in picks)  # ffmpeg-python escapes the commas
        raw, _ = (ffmpeg.input(r["video"]).filter("select", select).filter("scale", -2, SHORT_SIDE)
                  .output("pipe:", format="rawvideo", pix_fmt="rgb24",
                          vsync=0).run(capture_stdout=True, quiet=True))
        h = SHORT_SIDE
        w = len(raw) // (T * h * 3)
        frames = [Image.frombuffer("RGB", (w, h), raw[k * w * h * 3:(k + 1) * w * h * 3]) for k in range(T)]
        return self.transform.apply(frames, random.Random(i)), r["label"]


def whole_frames() -> None:
    """Make this process's transforms decode whole frames (libjpeg-turbo into reused memory,
    then the crop copied out), as a loader without crop decoding does."""
    from trainer.data import cropdecode, transforms
    buffer = {}

    def read_box(jpeg, box, d, out=None):
        w, h = cropdecode.scaled_size(jpeg, d)
        if buffer.get("frame") is None or buffer["frame"].shape != (h, w, 3):
            buffer["frame"] = np.empty((h, w, 3), np.uint8)
        frame = cropdecode.decode_crop(jpeg, (0, 0, w, h), d, buffer["frame"])[box[1]:box[3], box[0]:box[2]]
        if out is None:
            return frame.copy()
        out[...] = frame
        return out
    transforms.read_box = read_box


def make_loader(role: str, info: dict, batch_size: int):
    import torch
    from torch.utils.data import DataLoader

    from trainer.data import ClipLoader, EpochOptions
    from trainer.data.transforms import TrainTransform
    if role.startswith("shards"):
        if role == "shards-whole":
            whole_frames()
        return ClipLoader(info["shards_rst" if role.startswith("shards-rst") else "shards"], "train",
                          EpochOptions(batch_size=batch_size, train=not role.endswith("eval"),
                                       remainder="drop"), num_workers=1)
    dataset = (FrameFolders if role == "frames" else VideoFiles)(info["rows"], TrainTransform())
    collate = lambda b: (torch.from_numpy(np.stack([c for c, _ in b])),
                         torch.tensor([y for _, y in b]))  # noqa: E731
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=1, drop_last=True,
                      collate_fn=collate, generator=torch.Generator().manual_seed(0))


def cpu_seconds() -> float:
    """CPU time of this process and its live children (the loader's workers, ffmpeg)."""
    import psutil
    me = psutil.Process()
    total = 0.0
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_role(role: str, info: dict, batch_size: int, epochs: int) -> dict:
    """``epochs`` epochs; clips/s counted from each epoch's first batch to its last (worker
    start-up excluded), per core over the CPU time of all processes in that window."""
    if role.startswith(("decode", "encode")):
        return in_memory(role, info, epochs)
    loader = make_loader(role, info, batch_size)
    per_epoch = len(loader)
    clips = steady = seconds = cpu = 0
    for _ in range(epochs):
        syscalls.mark("epoch")  # phases of the syscall trace
        first = None
        for i, batch in enumerate(loader):
            n = len(batch["keys"]) if isinstance(batch, dict) else len(batch[1])
            clips += n
            if first is None:
                first, cpu_first = time.perf_counter(), cpu_seconds()
            else:
                steady += n
            if i == per_epoch - 1:
                seconds += time.perf_counter() - first
                cpu += cpu_seconds() - cpu_first
            del batch  # hands its slot back, as a training loop does
        syscalls.mark("after")
    return {"clips": clips, "epochs": epochs, "clips_per_s": steady / seconds, "clips_per_cpu_s": steady
            / cpu}


# --- measurements driven from the parent -----------------------------------------------------
def timed(roles: list[str], args) -> dict:
    """Best of ``args.repeat`` runs per role (wall-clock and CPU-time rates each), each in a fresh
    process, the roles interleaved so that load from other users of the machine falls on all of
    them alike."""
    best = {}
    for _ in range(args.repeat):
        for role in roles:
            epochs = "1" if role == "mp4" else "3"
            out = subprocess.run([sys.executable, __file__, "--role", role, "--out", args.out, "--epochs",
                                  epochs,
                                  "--batch-size", str(args.batch_size)], check=True, capture_output=True,
                                 text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            kept = best.setdefault(role, r)
            for rate in ("clips_per_s", "clips_per_cpu_s"):
                kept[rate] = max(kept[rate], r[rate])
    return best


def count_syscalls(role: str, args, data_roots: tuple[str, ...]) -> dict:
    """Metadata syscalls during one epoch, traced with strace -f (worker and ffmpeg processes too);
    strace slows the traced process, so this run is not timed."""
    done, trace = syscalls.trace([sys.executable, __file__, "--role", role, "--out", args.out,
                                  "--batch-size", str(args.batch_size)],
                                 os.path.join(args.out, f"strace-{role}.txt"), timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = Counter()
    for call in trace.phases.get("epoch", []):
        ours = call.path.startswith(data_roots)
        if call.kind == "fstat":
            counts["fstat (any fd)"] += 1
        elif call.name == "getdents64":
            counts["getdents64 (any dir)"] += 1
        elif call.kind in ("open", "listing"):
            counts[("opens" if call.kind == "open" else "listings") if ours else "other opens"] += 1
        elif call.kind == "stat" and ours:
            counts["stats"] += 1
    return dict(counts)


DECODERS = ("pillow-simd", "simplejpeg", "pyturbojpeg", "libjpeg-turbo")


def whole_decoder(name: str):
    """One of DECODERS: JPEG bytes -> a whole RGB frame, written into reused memory where the
    library allows it (fresh memory costs page faults on every frame)."""
    if name == "pillow-simd":
        from trainer.data.transforms import decode
        return lambda jpeg: decode(jpeg, SHORT_SIDE).load()
    buffer = {}

    def reused(shape):
        if buffer.get("frame") is None or buffer["frame"].shape != shape:
            buffer["frame"] = np.empty(shape, np.uint8)
        return buffer["frame"]
    if name == "simplejpeg":
        import simplejpeg
        side = dict(min_height=SHORT_SIDE, min_width=SHORT_SIDE)  # DCT scaling as far as that allows
        return lambda jpeg: simplejpeg.decode_jpeg(
            jpeg, buffer=reused(simplejpeg.decode_jpeg_header(jpeg, **side)[:2] + (3,)), **side)
    if name == "pyturbojpeg":  # no DCT scaling: none applies to the benchmark's frames
        import turbojpeg
        tj = turbojpeg.TurboJPEG()
        return lambda jpeg: tj.decode(jpeg, pixel_format=turbojpeg.TJPF_RGB,
                                      dst=reused(tuple(tj.decode_header(jpeg)[1::-1]) + (3,)))
    from trainer.data import cropdecode
    from trainer.data.transforms import dct_denom, jpeg_size, scaled

    def libjpeg(jpeg):
        w, h = jpeg_size(jpeg)
        d = dct_denom(w, h, SHORT_SIDE)
        sw, sh = scaled(w, h, d)
        return cropdecode.decode_crop(jpeg, (0, 0, sw, sh), d, reused((sh, sw, 3)))
    return libjpeg


def in_memory(kind: str, info: dict, passes: int) -> dict:
    """Clips/s on the clips' JPEG bytes held in memory (no I/O): whole-frame decoding by one
    decoder (``decode:NAME``; the fastest is the limit), or decoding plus a transform (what the
    loader could reach with free I/O and no batching), on the frames without restart markers or
    (``...-rst``) with them; or ingest's JPEG encoding of the decoded frames (``encode:N``,
    restart markers every N MCUs). Best pass; one thread."""
    from trainer.data.transforms import EvalTransform, TrainTransform
    clips = clip_bytes(info, kind.endswith("-rst"))
    kind = kind.removesuffix("-rst")
    train, evaluate = TrainTransform(), EvalTransform()
    if kind.startswith("decode:"):
        decoder = whole_decoder(kind.split(":", 1)[1])
        fn = lambda i, c: [decoder(b) for b in c]  # noqa: E731
    elif kind.startswith("encode:"):
        from PIL import Image

        from ingest import jpeg
        interval = int(kind.split(":", 1)[1])
        # 64: 180 MB of pixels
        clips = [[Image.open(io.BytesIO(b)).convert("RGB") for b in c] for c in clips[:64]]
        fn = lambda i, c: [jpeg.encode(im, QUALITY, interval) for im in c]  # noqa: E731
    else:
        if kind == "decode+train-whole":
            whole_frames()
        out = np.empty(train.shape(T), np.uint8)
        fn = {"decode+train": lambda i, c: train.into(c, random.Random(i), out),
              "decode+train-whole": lambda i, c: train.into(c, random.Random(i), out),
              "decode+eval": lambda i, c: evaluate.into(c, None, out)}[kind]
    best = best_cpu = 0.0
    for _ in range(passes):
        t, cpu = time.perf_counter(), time.process_time()
        for i, c in enumerate(clips):
            fn(i, c)
        best = max(best, len(clips) / (time.perf_counter() - t))
        best_cpu = max(best_cpu, len(clips) / (time.process_time() - cpu))
    return {"clips": len(clips), "epochs": passes, "clips_per_s": best, "clips_per_cpu_s": best_cpu}


def shuffle_quality(world: int, workers: int = 8, batch: int = 8, bufsize: int = 256, num_shards: int = 141,
                    per_shard: int = 1703, classes: int = 400, ranks_measured: int = 16, seed: int = 0,
                    per_node: int | None = None) -> dict:
    """Shuffle quality of one epoch's plan on a Kinetics-sized layout vs a random permutation.

    Measured on each rank's stream of clips: how far apart consecutive clips were in the
    stored order (fraction of the dataset; random: 1/3), how often consecutive clips come from
    the same shard (random: 1/shards), and distinct classes per batch, both with the stored
    order ingest writes (hash-shuffled) and with a class-sorted stored order (the worst case).
    ``per_node``: node-affine epochs on nodes of that many ranks (``shards.plan.partition.assign``).
    """
    n = num_shards * per_shard
    rng = np.random.default_rng(seed)
    stored_random = rng.permutation(np.arange(n) % classes)
    stored_sorted = np.sort(np.arange(n) % classes)
    nodes = world // per_node if per_node else 1
    orders = partition.epoch_orders([per_shard] * num_shards, nodes, seed, 0)
    lengths = tuple(len(o) for o in orders)
    seg = partition.Segment(world, workers, batch, nodes=nodes)

    def metrics(seqs):
        d = np.concatenate([np.abs(np.diff(s)) for s in seqs]) / n
        same = np.concatenate([np.diff(s // per_shard) == 0 for s in seqs])
        mix = {}
        for name, labels in (("hashed", stored_random), ("class_sorted", stored_sorted)):
            mix[name] = float(np.mean([len(set(labels[s[i:i + batch]])) for s in seqs
                                       for i in range(0, len(s) - batch + 1, batch)]))
        return {"consecutive_distance": float(d.mean()), "same_shard": float(same.mean()),
                "classes_per_batch": mix}

    ours, rand = [], []
    perm = rng.permutation(n)
    share = partition.per_rank(n, world, batch)
    for rank in range(min(world, ranks_measured)):
        seq = partition.rank_sequence(lengths, seg, rank, "pad", bufsize, seed, 0)
        order = orders[rank * nodes // world]
        ours.append(np.array([s * per_shard + i for s, i in (order.locate(p % len(order)) for p in seq)]))
        rand.append(perm[np.arange(rank * share, (rank + 1) * share) % n])
    return {"world_size": world, "nodes": nodes, "workers": workers, "batch": batch, "buffer": bufsize,
            "ours": metrics(ours), "random_permutation": metrics(rand)}


LOADERS = (("shards-rst", "(a) shards+RST, crop decoding"), ("shards", "(a) shards, crop decoding"),
           ("shards-whole", "(a) shards, whole frames"), ("shards-rst-eval", "(a) shards+RST, eval tf"),
           ("shards-eval", "(a) shards, eval tf"), ("frames", "(b) frame folders"),
           ("mp4", "(c) mp4 on the fly"))
MEMORY = ([("decode:" + d, "whole frames, " + d) for d in DECODERS]
          + [("decode:simplejpeg-rst", "whole+RST, simplejpeg"),
             ("decode+train-whole", "whole frames + train tf"), ("decode+train", "crop decoding + train tf"),
             ("decode+train-rst", "crop dec.+RST + train tf"), ("decode+eval", "crop decoding + eval tf"),
             ("decode+eval-rst", "crop dec.+RST + eval tf")])
ENCODERS = [("encode:0", "ingest encoding, no RST"), ("encode:%d" % RESTART, "ingest encoding, RST")]


def report(res: dict) -> str:
    limit, limit_cpu, mem = res["jpeg_limit"], res["jpeg_limit_cpu"], res["in_memory"]
    lines = [f"{res['clips']} clips of {T} frames, {res['clip_bytes'] / 1e3:.1f} kB each without restart "
             f"markers, {res['clip_bytes_rst'] / 1e3:.1f} kB with one every {res['restart_interval']} MCU "
             f"(+{res['clip_bytes_rst'] / res['clip_bytes'] - 1:.1%}; frames {res['frame_bytes']:.0f} and "
             f"{res['frame_bytes_rst']:.0f} bytes, ingest's encoder at quality {res['quality']}); batch "
             f"{res['batch_size']}, "
             "one DataLoader worker per loader; TSM train transform (multi-scale crop + flip to 224)", "",
             f"{'loader':<28} {'clips/s/worker':>14} {'x limit':>8} {'clips/s/core':>12} {'x limit':>8} | "
             f"{'opens':>6} {'stats':>6} {'listings':>8} {'fstat':>6} {'getdents':>8} {'other opens':>11}"]

    def rates(r):
        return (f"{r['clips_per_s']:>14.1f} {r['clips_per_s'] / limit:>8.2f} "
                f"{r['clips_per_cpu_s']:>12.1f} {r['clips_per_cpu_s'] / limit_cpu:>8.2f}")
    for role, label in LOADERS:
        if role not in res["loaders"]:
            continue
        r, c = res["loaders"][role], res["syscalls"].get(role, {})
        lines.append(f"{label:<28} {rates(r)} | {c.get('opens', 0):>6} {c.get('stats', 0):>6} "
                     f"{c.get('listings', 0):>8} {c.get('fstat (any fd)', 0):>6} "
                     f"{c.get('getdents64 (any dir)', 0):>8} {c.get('other opens', 0):>11}")
    lines.append("in memory (JPEG bytes in memory, no I/O, no batching, one thread):")
    for role, label in MEMORY:
        lines.append(f"{'  ' + label:<28} {rates(mem[role])} |"
                     + ("  the full-decode limit" if mem[role]["clips_per_s"] == limit else ""))
    for role, label in ENCODERS:
        lines.append(f"{'  ' + label:<28} {mem[role]['clips_per_s']:>14.1f} clips/s "
                     f"{mem[role]['clips_per_cpu_s']:>21.1f} clips/CPU-s")
    lines += ["", "opens/stats/listings: of files under the data directory during one epoch, all processes;",
              "fstat: on any open descriptor; other opens: outside the data directory (libraries, /dev/shm, "
              "/proc).",
              f"shards read by (a): {res['shards_read']} (the rank opens each once; its worker shares the "
              f"descriptor)", ""]
    for q in res["shuffle"]:
        o, r = q["ours"], q["random_permutation"]
        mode = f"node-affine on {q['nodes']} nodes" if q["nodes"] > 1 else "global"
        lines.append(f"shuffle quality, {mode}, {q['world_size']} ranks x {q['workers']} workers, batch "
                     f"{q['batch']}, buffer {q['buffer']} (Kinetics-sized: 141 shards x 1,703 clips, 400 "
                     f"classes):")
        lines.append(f"  consecutive clips' distance in stored order: {o['consecutive_distance']:.4f} of the "
                     f"set (random {r['consecutive_distance']:.3f}); same shard: {o['same_shard']:.3f} "
                     f"(random {r['same_shard']:.4f})")
        lines.append(f"  distinct classes per batch: {o['classes_per_batch']['hashed']:.2f} with ingest's "
                     f"hashed order (random {r['classes_per_batch']['hashed']:.2f}); "
                     f"{o['classes_per_batch']['class_sorted']:.2f} if stored class-sorted (random "
                     f"{r['classes_per_batch']['class_sorted']:.2f})")
    lines += ["", "shards plan, Kinetics-400 (240,000 clips), 8 workers and batch 8 per rank:"]
    for row in res["plan"]["rows"]:
        s = row["shards"]
        lines.append(f"  {row['world_size']:>5} ranks: shards {s['opens_per_rank_mean']:.2f} opens/rank "
                     f"(max {s['opens_per_rank_max']}), {s['total']:,.0f} ops/epoch; frame folders "
                     f"{row['frame_folders']['total']:,.0f}; one file per video "
                     f"{row['video_files']['total']:,.0f}; {row['frame_folders_over_shards']:,.0f}x fewer "
                     f"than frame folders")
    lines.append(f"  recommended: {res['plan']['num_shards']} shards of {res['plan']['shard_mb']:.0f} MB")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/kinetics-fast-bench-loader", help="working directory (reused)")
    p.add_argument("--videos-dir", help="mp4 files to use instead of synthetic ones")
    p.add_argument("--videos", type=int, default=256, help="videos (one clip each)")
    p.add_argument("--seconds", type=float, default=4, help="length of synthetic videos")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3, help="timed epochs per loader (best is kept)")
    p.add_argument("--skip", nargs="+", default=[], choices=[role for role, _ in LOADERS],
                   help="loaders to leave out (mp4 takes minutes per run on a busy machine)")
    p.add_argument("--fresh", action="store_true", help="rebuild the working directory")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fresh and not args.role:
        shutil.rmtree(args.out, ignore_errors=True)
    info = prepare(args.out, args.videos_dir, args.videos, args.seconds)
    if args.role:
        print(json.dumps(run_role(args.role, info, args.batch_size, args.epochs)))
        return 0
    roles = [role for role, _ in LOADERS if role not in args.skip]
    memory_roles = [role for role, _ in MEMORY + ENCODERS]
    roots = tuple(os.path.abspath(d) for d in (args.out, args.videos_dir) if d)
    speeds = timed(memory_roles + roles, args)
    res = {**{k: info[k] for k in ("clips", "clip_bytes", "clip_bytes_rst", "frame_bytes", "frame_bytes_rst",
                                   "quality", "restart_interval")}, "batch_size": args.batch_size,
           "in_memory": {k: speeds.pop(k) for k in memory_roles},
           "loaders": speeds,
           "syscalls": {r: count_syscalls(r, args, roots) for r in roles
                        if shutil.which("strace") and r in ("shards", "shards-eval", "frames", "mp4")},
           "shards_read": len(Manifest.load(info["shards"]).splits["train"].shards),
           "shuffle": [shuffle_quality(8), shuffle_quality(1536), shuffle_quality(8, per_node=4),
                       shuffle_quality(1536, per_node=6)],
           "plan": layout.plan(layout.Totals(240_000, info["clip_bytes"], T), 6144, 8, 8, [1536, 6144])}
    for key, rate in (("jpeg_limit", "clips_per_s"), ("jpeg_limit_cpu", "clips_per_cpu_s")):
        res[key] = max(res["in_memory"]["decode:" + d][rate] for d in DECODERS)
    print(report(res))
    print("BENCH_JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
