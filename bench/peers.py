"""This project's reading API against the streaming loaders a researcher would pick instead.

Each peer writes the same clips in its own format with its own writer and reads them with its own
documented loader; every loader applies the same per-clip work (TSM's multi-scale crop to 224 and flip,
one draw per clip, ``trainer.data.transforms.multiscale_box``), reads every clip once per epoch with
batches of 8, and the clips each batch holds are counted (not assumed). The peers' frames are the same
scenes encoded without restart markers, as their own writers would store them (``--peer-markers``: the
very bytes of ours, markers included, which make their whole-frame decode about 10% dearer):

* ``ours``: ``trainer.data.ClipLoader`` on this project's shards (crop-only decoding of the JPEGs with
  restart markers, ``trainer/libcropjpeg.so``; OpenCV resize; shared-memory batch slots);
* ``ours-dataset``: ``trainer.data.ClipDataset`` in a plain ``DataLoader`` (the same decoding, but the
  batch travels as a new shared-memory tensor, as the peers' do);
* ``webdataset``: ``wds.ShardWriter`` tars, ``wds.WebDataset(...).shuffle(256).map(...).batched(8)`` in a
  ``wds.WebLoader`` (shards split by worker), frames decoded whole with simplejpeg, cropped and resized
  with OpenCV;
* ``litdata``: ``litdata.optimize`` chunks, a ``litdata.StreamingDataset`` (shuffled) whose
  ``__getitem__`` does the same decode and crop, in a ``litdata.StreamingDataLoader``;
* ``mosaic``: MosaicML streaming's ``MDSWriter`` shards, its ``StreamingDataset`` (shuffled, told the
  batch size), the same decode and crop in ``__getitem__``, in a torch ``DataLoader``.

``--baseline DIR`` adds ``ours-base``: ``ClipLoader`` of another checkout of this project (``git archive
main | tar -x -C DIR``, with its ``trainer/libcropjpeg.so``), run by that checkout's own copy of this script,
interleaved with the rest, so a change to the loader is measured against what it changes in the same runs.

Sources: ``local`` (the files on this disk) and ``http`` (a plain HTTP/1.1 server with byte ranges on
127.0.0.1, ``tests/helpers/shardsets.serve``, in its own process: ``ours`` reads the manifest and byte ranges;
webdataset reads whole shards through ``curl``, its documented way; LitData and MosaicML streaming
have no plain-HTTP source, only object stores, so they are measured locally only).

Every (loader, workers, source) runs in a process of its own, ``--runs`` times, the combinations
interleaved; printed are medians of: clips per CPU-second of the process and all its workers (the
figure a loaded machine disturbs least: what a worker costs), clips/s over the epochs after the first (each
epoch timed from asking for its iterator, so workers started per epoch count, as in training; the first epoch
is left out: imports, index building, the first page faults), clips/s with start-up (every epoch, from
constructing the dataset), the time to the first batch, and the ratios of ``ours`` to the best peer. The load
averages seen are printed with every run: on a shared machine they say how far to trust the numbers.

The peers pin older numpy and xxhash than this project's tested set, and MosaicML streaming imports
torchvision, whose PyPI wheel does not import beside the CPU torch 2.13.0 wheel of this machine: they
live in a venv of their own, which holds this project too (its base install takes any torch >= 2.4):

    python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.14.1 torchvision==0.29.1
    .venv-peers/bin/pip install -e ".[bench]" && bash scripts/build-native.sh
    nice .venv-peers/bin/python bench/peers.py --out /tmp/peers --runs 3 --workers 1 2

The last line is ``BENCH_JSON {...}`` with every run.

``--clip-work CLIPS`` times instead only the per-clip work, in this process and without any loader: ours
(crop-only decoding and the resize) against the peers' ``crop_clip``, interleaved ``--runs`` times; their
ratio bounds what a loader with no cost of its own could lead by (docs/benchmarks/peers.md).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

T, CROP, SCALE, BATCH, SHUFFLE = 8, 224, 256, 8, 256
LOADERS = ("ours", "ours-dataset", "webdataset", "litdata", "mosaic")
PEERS = LOADERS[2:]
BASE = "ours-base"  # ``ours`` of the --baseline checkout
METRICS = (("steady", "clips/s"), ("per_cpu", "clips per CPU-second"), ("with_startup", "with start-up"))
REMOTE = ("ours", "ours-dataset", "webdataset", BASE)  # the loaders that read from a plain HTTP server


# --- the clips, written by each writer ---------------------------------------------------------
def frames_of(clip: int, size=(340, 256), restart_interval: int = 1) -> list[bytes]:
    """``T`` JPEG frames (ingest's encoder: quality 90, restart markers every ``restart_interval`` MCUs;
    0: none) of a textured scene panning."""
    from PIL import Image

    from ingest.jpeg import encode

    rng = np.random.default_rng(clip)
    coarse = Image.fromarray(rng.integers(0, 256, (size[1] // 8 + 8, size[0] // 8 + 8, 3), dtype=np.uint8))
    scene = np.asarray(coarse.resize((coarse.width * 8, coarse.height * 8), Image.BICUBIC))
    grain = rng.integers(-3, 4, scene.shape, dtype=np.int16)
    scene = np.clip(scene + grain, 0, 255).astype(np.uint8)
    return [encode(Image.fromarray(np.ascontiguousarray(scene[t * 4: t * 4 + size[1],
                                                              t * 6: t * 6 + size[0]])),
                   90, restart_interval)
            for t in range(T)]


def write_all(out: str, clips: int, shards: int, peer_markers: bool) -> dict:
    """Every format under ``out`` (made once; kept for later runs that ask for the same frames). The
    peers' frames carry no restart markers unless ``peer_markers`` (the same scenes, encoded as a peer's
    own writer would: the markers that ours crops by cost a whole-frame decode about 10%)."""
    done = os.path.join(out, "written.json")
    if os.path.exists(done):
        info = json.load(open(done))
        if (info["clips"], info["shards"], info.get("peer_markers", True)) == (clips, shards, peer_markers):
            return info
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    data = [(f"clip{i:05d}", i % 10, frames_of(i)) for i in range(clips)]
    plain = data if peer_markers else [(key, label, frames_of(i, restart_interval=0))
                                       for i, (key, label, _) in enumerate(data)]
    per = clips // shards
    sizes = {name: write(name, os.path.join(out, name), data if name == "ours" else plain, per)
             for name in ("ours", "webdataset", "litdata", "mosaic")}
    info = {"clips": clips, "shards": shards, "peer_markers": peer_markers, "bytes": sizes,
            "frame_bytes": int(np.mean([len(f) for _, _, fs in data[:32] for f in fs]))}
    json.dump(info, open(done, "w"))
    return info


def write(name: str, where: str, data, per: int) -> int:
    if name == "ours":
        from shards.format.manifest import Manifest, SplitInfo, digest
        from shards.format.packing import shard_name, write_shard
        from shards.format.tar import sample_bytes

        os.makedirs(where)
        samples = [(key, label, sample_bytes(key, [(f"{t:02d}.jpg", f) for t, f in enumerate(fs)]
                                             + [("cls", str(label).encode()),
                                                ("json", json.dumps({"video": key}).encode())]))
                   for key, label, fs in data]
        infos = [write_shard(os.path.join(where, shard_name("train", k)), shard_name("train", k),
                             samples[k * per:(k + 1) * per]) for k in range(len(samples) // per)]
        Manifest(classes=[f"c{i}" for i in range(10)], splits={"train": SplitInfo(shards=infos)},
                 config={"clip": {"frames": T, "short_side": 256}},
                 fingerprint=digest(len(samples))).save(where)
    elif name == "webdataset":
        import webdataset as wds

        os.makedirs(where)
        with wds.ShardWriter(os.path.join(where, "shard-%06d.tar"), maxcount=per, verbose=0) as sink:
            for key, label, fs in data:
                sink.write({"__key__": key, "cls": label, **{f"{t:02d}.jpg": f for t, f in enumerate(fs)}})
    elif name == "litdata":
        from litdata import optimize

        optimize(fn=_litdata_item, inputs=[(label, fs) for _, label, fs in data], output_dir=where,
                 chunk_size=per, num_workers=1, verbose=False, mode="overwrite")
    else:
        from streaming import MDSWriter

        columns = {"label": "int", **{f"f{t}": "bytes" for t in range(T)}}
        size = sum(len(f) for fs in (d[2] for d in data[:per]) for f in fs) + 4096 * per
        with MDSWriter(out=where, columns=columns, size_limit=size) as sink:
            for _, label, fs in data:
                sink.write({"label": label, **{f"f{t}": f for t, f in enumerate(fs)}})
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(where) for f in fs)


def _litdata_item(item):
    label, fs = item
    return {"label": label, **{f"f{t}": f for t, f in enumerate(fs)}}


# --- the peers' per-clip work: simplejpeg whole-frame decode, the crop with OpenCV ----------------------
def crop_clip(jpegs: list[bytes], rng: random.Random):
    import cv2
    import simplejpeg
    import torch

    from trainer.data.transforms import multiscale_box

    cv2.setNumThreads(1)
    out = np.empty((len(jpegs), CROP, CROP, 3), dtype=np.uint8)
    box, flip = None, False
    for t, jpeg in enumerate(jpegs):
        frame = simplejpeg.decode_jpeg(jpeg, colorspace="RGB")
        if box is None:
            box = multiscale_box(frame.shape[1], frame.shape[0], CROP, rng)
            flip = rng.random() < 0.5
        x0, y0, x1, y1 = box
        cv2.resize(frame[y0:y1, x0:x1], (CROP, CROP), dst=out[t], interpolation=cv2.INTER_LINEAR)
        if flip:
            cv2.flip(out[t], 1, dst=out[t])
    return torch.from_numpy(out).permute(0, 3, 1, 2)


def loader_of(name: str, where: str, workers: int, epochs: int):
    """A function making the iterable of each epoch (its batches), and how many clips a batch has."""
    import torch

    if name == "ours":
        from trainer.data import ClipLoader, EpochOptions

        loader = ClipLoader(where, "train", EpochOptions(batch_size=BATCH, shuffle_buffer=SHUFFLE),
                            num_workers=workers, crop_size=CROP, scale_size=SCALE)
        return (lambda epoch: (loader.set_epoch(epoch), loader)[1]), lambda b: int(b["valid"].sum())
    if name == "ours-dataset":
        from torch.utils.data import DataLoader

        from trainer.data import ClipDataset

        dataset = ClipDataset(where, "train", batch_size=BATCH, crop_size=CROP, scale_size=SCALE,
                              shuffle_buffer=SHUFFLE)
        loader = DataLoader(dataset, batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0)
        return (lambda epoch: loader), lambda b: int(b["valid"].sum())
    if name == "webdataset":
        import webdataset as wds

        def decode(sample):
            jpegs = [sample[k] for k in sorted(k for k in sample if k.endswith(".jpg"))]
            return crop_clip(jpegs,
                             random.Random(f"{sample['__key__']}/{time.monotonic_ns()}")), int(sample["cls"])

        shards = sorted(os.path.join(where, f) for f in os.listdir(where)) if "://" not in where else \
            [f"{where}/shard-{i:06d}.tar" for i in range(int(os.environ["PEERS_SHARDS"]))]
        dataset = (wds.WebDataset(shards, shardshuffle=len(shards), nodesplitter=wds.split_by_node,
                                  workersplitter=wds.split_by_worker, empty_check=False)
                   .shuffle(SHUFFLE).map(decode).batched(BATCH, partial=True))
        loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
        return (lambda epoch: loader), lambda b: len(b[1])
    if name == "litdata":
        import litdata

        class Clips(litdata.StreamingDataset):
            def __getitem__(self, index):
                item = super().__getitem__(index)
                # index: LitData's ChunkedIndex
                draw = random.Random(f"{index.index}/{getattr(self, 'current_epoch', 0)}")
                return crop_clip([item[f"f{t}"] for t in range(T)], draw), item["label"]

        loader = litdata.StreamingDataLoader(Clips(where, shuffle=True), batch_size=BATCH,
                                             num_workers=workers)
        return (lambda epoch: loader), lambda b: len(b[1])
    import streaming

    class Clips(streaming.StreamingDataset):
        def __getitem__(self, index):
            item = super().__getitem__(index)
            return crop_clip([item[f"f{t}"] for t in range(T)],
                             random.Random(f"{int(index)}/{getattr(self, 'next_epoch', 0)}")), \
                item["label"]

    streaming.base.util.clean_stale_shared_memory()
    dataset = Clips(local=where, shuffle=True, batch_size=BATCH, shuffle_seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers,
                                         persistent_workers=workers > 0)
    return (lambda epoch: loader), lambda b: len(b[1])


def clip_work(clips: int, repeats: int) -> str:
    """The per-clip work alone, in this process, interleaved ``repeats`` times over the first ``clips``
    clips: ours (``TrainTransform.into``: crop-only decoding, then the resize, into one reused slot), the
    decoding of ours alone, and the peers' (``crop_clip``: whole-frame decoding, crop and resize), on the
    frames the sets hold and on the same frames written without restart markers (what a peer's own
    writer would store: the markers cost a whole-frame decode some speed), and the peers' decoding alone
    on those. The ratio is the lead a loader with no cost of its own beyond that work would have."""
    import simplejpeg

    from trainer.data import cropdecode
    from trainer.data.transforms import TrainTransform

    lib = cropdecode.load()
    if lib is None:
        raise SystemExit("peers: --clip-work needs trainer/libcropjpeg.so (scripts/build-native.sh)")
    data = [frames_of(c) for c in range(clips)]
    plain = [frames_of(c, restart_interval=0) for c in range(clips)]
    transform = TrainTransform(CROP, SCALE)
    slot = np.empty(transform.shape(T), dtype=np.uint8)

    def ours():
        rng = random.Random(0)
        for jpegs in data:
            transform.into(jpegs, rng, slot)

    def decoding():
        rng = random.Random(0)
        for jpegs in data:
            geometry, d, size = transform.draw(jpegs[0], rng)
            for jpeg in jpegs:
                cropdecode.decode_crop(jpeg, geometry.region(*size), d, None, lib)

    def peer(clips_of):
        rng = random.Random(0)
        for jpegs in clips_of:
            crop_clip(jpegs, rng)

    def peer_decoding():
        for jpegs in plain:
            for jpeg in jpegs:
                simplejpeg.decode_jpeg(jpeg, colorspace="RGB")

    work = {"ours": ours, "ours, decoding only": decoding, "peers (crop_clip)": lambda: peer(data),
            "peers, no markers": lambda: peer(plain), "peers, decoding only": peer_decoding}
    times = {name: [] for name in work}
    for _ in range(repeats):
        for name, run in work.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / clips * 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    lines = [f"per-clip work, {clips} clips, medians of {repeats} interleaved repeats, load "
             f"{os.getloadavg()[0]:.1f}:"]
    lines += [f"  {name:22s} {m:.2f} ms a clip (range {min(times[name]):.2f}-{max(times[name]):.2f})"
              for name, m in med.items()]
    lines.append(f"  peers / ours: {med['peers (crop_clip)'] / med['ours']:.2f}x; without markers "
                 f"{med['peers, no markers'] / med['ours']:.2f}x; decoding alone (ours: the crop, about half "
                 f"the pixels; the peers': the whole frame, no markers) "
                 f"{med['peers, decoding only'] / med['ours, decoding only']:.2f}x")
    return "\n".join(lines)


def tree_cpu() -> float:
    """CPU seconds of this process and all its descendants, live or reaped (/proc: utime, stime, and
    the cutime and cstime of the children each has waited for)."""
    tick, procs = os.sysconf("SC_CLK_TCK"), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        procs[int(pid)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / tick)
    tree, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, (parent, _) in procs.items() if parent in tree} - tree
        tree, grew = tree | more, bool(more)
    return sum(procs[pid][1] for pid in tree if pid in procs)


def one_run(name: str, where: str, workers: int, epochs: int) -> dict:
    """In a process of its own: ``epochs`` epochs; clips counted from the batches."""
    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    epoch_of, count = loader_of(name, where, workers, epochs)
    first, per_epoch, starts, cpus = None, [], [], []
    for epoch in range(epochs):
        n = 0
        starts.append(time.perf_counter())
        cpus.append(tree_cpu())
        for batch in epoch_of(epoch):
            if first is None:
                first = time.perf_counter()
            n += count(batch)
        per_epoch.append(n)
    end, cpu = time.perf_counter(), tree_cpu()
    # epoch 1 left out of the rate: imports, indexes, first page faults
    later = slice(1 if epochs > 1 else 0, None)
    return {"clips": sum(per_epoch), "per_epoch": per_epoch, "first_batch_s": first - start,
            "steady": sum(per_epoch[later]) / (end - starts[later][0]),
            "per_cpu": sum(per_epoch[later]) / (cpu - cpus[later][0]),
            "with_startup": sum(per_epoch) / (end - start), "load": os.getloadavg()[0]}


def serve_everything(out: str):
    """``out`` over HTTP (byte ranges) from a process of its own; its URL and the process."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[2]); from helpers.shardsets import serve\n"
            "with serve(sys.argv[1]) as (url, _):\n    print(url, flush=True)\n    time.sleep(1e9)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, out, os.path.join(ROOT, "tests")],
                            stdout=subprocess.PIPE, text=True)
    return proc.stdout.readline().strip(), proc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/kf-peers",
                   help="where the formats are written (kept for later runs)")
    p.add_argument("--clips", type=int, default=384)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=LOADERS)
    p.add_argument("--sources", nargs="+", default=["local", "http"], choices=["local", "http"])
    p.add_argument("--baseline", metavar="DIR", help="another checkout whose ClipLoader runs as ours-base")
    p.add_argument("--peer-markers", action="store_true",
                   help="write the peers' frames with ours' restart markers too (default: without, as their "
                        "own writers would)")
    p.add_argument("--clip-work", type=int, metavar="CLIPS",
                   help="time only the per-clip work of ours and of the peers, in-process (no loaders)")
    p.add_argument("--one", nargs=4, metavar=("LOADER", "WHERE", "WORKERS", "EPOCHS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print("RUN_JSON", json.dumps(one_run(a.one[0], a.one[1], int(a.one[2]), int(a.one[3]))), flush=True)
        return 0
    if a.clip_work:
        print(clip_work(a.clip_work, a.runs))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the HTTP server is stopped on a kill too
    info = write_all(a.out, a.clips, a.shards, a.peer_markers)
    print(f"{a.clips} clips of {T} frames (340x256, {info['frame_bytes']:,} bytes a frame) in {a.shards} "
          f"shards, the peers' {'with' if a.peer_markers else 'without'} restart markers; bytes by format: "
          f"{info['bytes']}", flush=True)
    url, server = serve_everything(a.out) if "http" in a.sources else (None, None)
    loaders = a.loaders + ([BASE] if a.baseline else [])
    combos = [(name, w, src) for src in a.sources for w in a.workers for name in loaders
              if src == "local" or name in REMOTE]
    runs = []
    try:
        for r in range(a.runs):
            for name, w, src in combos:
                where = os.path.join(a.out, "ours" if name.startswith("ours") else name)
                if src == "http":
                    where = f"{url}/{os.path.basename(where)}"
                env = {**os.environ, "PEERS_SHARDS": str(a.shards), "PYTHONPATH": ROOT}
                if name == "mosaic":  # its local cache of the index, per run
                    shutil.rmtree("/dev/shm/streaming", ignore_errors=True)
                script, loader = (os.path.join(a.baseline, "bench", "peers.py"),
                                  "ours") if name == BASE else \
                    (__file__, name)
                proc = subprocess.run([sys.executable, script, "--one", loader, where, str(w), str(a.epochs)],
                                      capture_output=True, text=True, env=env, timeout=1800)
                line = [x for x in proc.stdout.splitlines() if x.startswith("RUN_JSON ")]
                if proc.returncode or not line:
                    print(f"{name} w={w} {src}: failed\n{proc.stderr[-3000:]}", flush=True)
                    continue
                res = {"loader": name, "workers": w, "source": src, "run": r, **json.loads(line[0][9:])}
                runs.append(res)
                print(f"run {r} {src:5s} w={w} {name:12s} clips {res['clips']} ({res['per_epoch']}) "
                      f"{res['steady']:7.1f} clips/s, {res['per_cpu']:6.1f} per CPU-s, "
                      f"{res['with_startup']:7.1f} with start-up, first batch {res['first_batch_s']:.2f} s, "
                      f"load {res['load']:.1f}", flush=True)
    finally:
        if server:
            server.kill()
            server.wait()
    print(report(runs, a))
    print("BENCH_JSON", json.dumps({"info": info, "runs": runs}))
    return 0


def report(runs: list[dict], a) -> str:
    med = {}
    for key in {(r["loader"], r["workers"], r["source"]) for r in runs}:
        rs = [r for r in runs if (r["loader"], r["workers"], r["source"]) == key]
        med[key] = {m: statistics.median(r[m] for r in rs)
                    for m in ("steady", "per_cpu", "with_startup", "first_batch_s")}
    lines = ["", "medians | source | workers | loader | clips/s | clips per CPU-second | with start-up | "
                 "first batch s"]
    order = (*LOADERS, BASE)
    for (name, w, src), m in sorted(med.items(), key=lambda kv: (kv[0][2], kv[0][1], order.index(kv[0][0]))):
        lines.append(f"| {src} | {w} | {name} | {m['steady']:.1f} | {m['per_cpu']:.1f} | "
                     f"{m['with_startup']:.1f} | {m['first_batch_s']:.2f} |")
    lines.append("")
    for src in a.sources:
        for w in a.workers:
            peers = {n: med[(n, w, src)] for n in PEERS if (n, w, src) in med}
            if (("ours", w, src) not in med) or not peers:
                continue
            ours = med[("ours", w, src)]
            ratios = []
            for metric, words in METRICS:
                best = max(peers, key=lambda n: peers[n][metric])
                ratios.append(f"{words} {ours[metric] / peers[best][metric]:.2f}x ({best})")
            lines.append(f"{src}, {w} worker(s): ours / the best peer: " + "; ".join(ratios))
            if (BASE, w, src) in med:
                base = med[(BASE, w, src)]
                lines.append(f"{src}, {w} worker(s): ours / ours-base: " + "; ".join(
                    f"{words} {ours[metric] / base[metric]:.2f}x" for metric, words in METRICS))
    loads = [r["load"] for r in runs]
    lines.append(f"load average (1 min) seen at the ends of the runs: {min(loads):.1f}-{max(loads):.1f} on "
                 f"{os.cpu_count()} cores" if loads else "no runs")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
