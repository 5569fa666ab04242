"""Two streams on the CPU: RGB TSN and TSM, motion TSNs (codec motion vectors, optical flow), their late
fusions.

Two ``ingest synth`` tasks, 64x64 videos of 2 s at 10 fps, 256 training and 64 validation videos each:

* ``direction``: four classes that differ only in the direction a textured disc moves (any single
  frame fits every class): the motion stream's task; an RGB TSN stays near chance;
* ``colour-direction``: ``--colours 2``, eight classes, the disc's colour (red, green) x the four
  directions: a single frame tells the colour, a motion field the direction, neither both.

Each task's videos are ingested twice into 4-frame clips (four per training video, 32 px short side),
with ``ingest build --motion mv`` (the codec's motion vectors) and ``--motion flow`` (OpenCV DIS
flow); the JPEG frames of both are the same. Every model is the demo's (scripts/demo.sh): a
ResNet-10 of width 16 on 32 px crops, batch 16, the same recipe and epochs for all, two runs at a
time on one core each:

* ``rgb-tsn`` (``--no-shift``) and ``rgb-tsm`` on the frames (of the mv build),
* ``mv-tsn`` and ``flow-tsn``: ``--modality motion --no-shift`` on each build's fields.

Each run is tested on the validation videos (``trainer test``, centre crop, one clip per video), and
every RGB run is fused with every motion run (``trainer test --fuse RGB MOTION --weights 1 1.5``,
TSN's weights; the flow run is scored on its own build). The table gives video top-1 per task.

    PYTHONPATH=. .venv/bin/python bench/two_stream.py                 # work in /tmp/kinetics-fast-two-stream
    PYTHONPATH=. .venv/bin/python bench/two_stream.py --epochs 8 --tasks direction --json two_stream.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from synthsets import BIN, ENV, start_training, synth_shards

TASKS = {"direction": ["--classes", "4"], "colour-direction": ["--classes", "4", "--colours", "2"]}
CLASSES = {"direction": 4, "colour-direction": 8}
MOTIONS = ("mv", "flow")
# scripts/demo.sh's model and recipe (tests/test_motion.py's), for every run
RUN = ["--segments", "4", "--depth", "10", "--width", "16", "--crop-size", "32", "--scale-size", "32",
       "--no-flip", "--batch-size", "16", "--warmup-epochs", "1", "--lr-per-8", "0.1", "--workers", "0",
       "--print-freq", "64", "--no-tensorboard"]
# name: (shard set, flags)
MODELS = {"rgb-tsn": ("mv", ["--no-shift"]), "rgb-tsm": ("mv", []),
          "mv-tsn": ("mv", ["--modality", "motion", "--no-shift"]),
          "flow-tsn": ("flow", ["--modality", "motion", "--no-shift"])}
LABELS = {"rgb-tsn": "RGB TSN", "rgb-tsm": "RGB TSM", "mv-tsn": "motion TSN (mv)",
          "flow-tsn": "motion TSN (flow)"}


def make_sets(work: Path, task: str, videos_per_task: int, val_per_task: int) -> dict[str, Path]:
    """The task's videos, ingested once with each motion kind: {kind: shard set}."""
    classes = CLASSES[task]
    synth = [*TASKS[task], "--train-per-class", str(videos_per_task // classes), "--val-per-class",
             str(val_per_task // classes), "--width", "64", "--height", "64", "--fps", "10", "--seconds", "2",
             "--workers", "2"]
    return {kind: synth_shards(work / task / "videos", work / task / f"shards-{kind}", synth,
                               ["--frames", "4", "--clips-per-video", "4", "--short-side", "32",
                                "--shard-samples", "64", "--workers", "2", "--motion", kind])
            for kind in MOTIONS}


def train_all(work: Path, sets: dict[str, Path], epochs: int) -> dict[str, float]:
    """Every model of ``MODELS``, two at a time (one core each); {name: wall-clock seconds}."""
    walls, names = {}, list(MODELS)
    for pair in (names[i:i + 2] for i in range(0, len(names), 2)):
        start = time.perf_counter()
        procs = {name: start_training(sets[MODELS[name][0]], work / name,
                                      [*RUN, "--epochs", str(epochs), *MODELS[name][1]]) for name in pair}
        for name, proc in procs.items():
            if proc.wait():
                raise SystemExit(f"two_stream: {name} failed, see {work / name}.log")
            walls[name] = time.perf_counter() - start
    return walls


def fuse(work: Path, sets: dict[str, Path], rgb: str, motion: str, weights: list[str]) -> dict:
    """``trainer test --fuse`` of the two runs on the validation videos: its summary line."""
    out = subprocess.run([str(BIN / "python"), "-m", "trainer", "test", "--fuse", str(work / rgb),
                          str(work / motion), "--weights", *weights,
                          "--data", str(sets[MODELS[rgb][0]]), str(sets[MODELS[motion][0]]),
                          "--backend", "none", "--workers", "0"],
                         check=True, capture_output=True, text=True, env={**ENV, "OMP_NUM_THREADS": "2"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/kinetics-fast-two-stream", help="data and runs")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    p.add_argument("--epochs", type=int, default=16, help="of every run")
    p.add_argument("--train-videos", type=int, default=256, help="per task, spread over its classes")
    p.add_argument("--val-videos", type=int, default=64, help="per task, spread over its classes")
    p.add_argument("--weights", nargs=2, default=["1", "1.5"],
                   help="of the RGB and the motion run in each fusion")
    p.add_argument("--json", help="also write every figure here")
    args = p.parse_args()

    work = Path(args.work)
    results, loads = {}, []
    for task in args.tasks:
        sets = make_sets(work, task, args.train_videos, args.val_videos)
        loads.append(os.getloadavg()[0])
        walls = train_all(work / task, sets, args.epochs)
        alone, fused = {}, {}
        for rgb in ("rgb-tsn", "rgb-tsm"):
            for motion in ("mv-tsn", "flow-tsn"):
                line = fuse(work / task, sets, rgb, motion, args.weights)
                for name, stream in zip((rgb, motion), line["streams"]):
                    alone[LABELS[name]] = stream["video_top1"]
                fused[f"{LABELS[rgb]} + {LABELS[motion]}"] = line["video_top1"]
        rows = {**{LABELS[name]: alone[LABELS[name]] for name in MODELS}, **fused}
        results[task] = {"top1": rows, "train_seconds": walls, "chance": 100 / CLASSES[task]}
        print(f"{task}: trained in {', '.join(f'{k} {v:.0f} s' for k, v in walls.items())}", flush=True)

    print(f"\nvalidation video top-1 (%), {args.epochs} epochs, fusion weights RGB {args.weights[0]} : "
          f"motion {args.weights[1]}; load average at the starts of training: "
          f"{', '.join(f'{x:.1f}' for x in loads)}")
    names = list(results[args.tasks[0]]["top1"])
    width = max(map(len, names))
    print(f"{'model':<{width}} | " + " | ".join(f"{t:>16}" for t in args.tasks))
    print(f"{'(chance)':<{width}} | " + " | ".join(f"{results[t]['chance']:16.1f}" for t in args.tasks))
    for name in names:
        print(f"{name:<{width}} | " + " | ".join(f"{results[t]['top1'][name]:16.1f}" for t in args.tasks))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"epochs": args.epochs, "weights": args.weights, "run": RUN, "models": MODELS,
                       "loads": loads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
