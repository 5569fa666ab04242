"""Two ranks on one machine, with the trainer's intra-op thread cap and without it, side by side.

``horovodrun -np 2 -H localhost:2 --gloo trainer train ...`` as the README runs it on one machine,
on a small synthetic shard set: ``capped`` leaves OMP_NUM_THREADS unset, so each rank takes its
share of the cores (``trainer.distributed.cores``: affinity cores / local ranks); ``uncapped``
sets OMP_NUM_THREADS to every core the machine gives, which the trainer respects, i.e. PyTorch's
own default, as every rank ran before the cap. The two alternate, so load from elsewhere hits both
alike; each run's figure is the training throughput of its epoch over every rank (``clips_per_s``
of the epoch record in metrics.jsonl: training steps only, start-up and checkpoint excluded).
Prints one JSON line per run, then the medians and their ratio.

    PYTHONPATH=. python bench/threads.py [--repeats 3] [--clips 96] [--dir DIR]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.shardsets import make_shardset  # noqa: E402

HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
FLAGS = ["--depth", "18", "--width", "16", "--crop-size", "48", "--scale-size", "48", "--batch-size", "4",
         "--epochs", "1", "--val-split", "", "--no-tensorboard", "--print-freq", "1000"]


def run(data: Path, out: Path, capped: bool) -> float:
    """One two-rank training epoch; -> its clips/s over both ranks."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if not capped:
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m",
                        "trainer", "train", "--data", str(data), "--output-dir", str(out), *FLAGS],
                       env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise SystemExit(f"horovodrun exited {p.returncode}: {p.stdout[-2000:]}{p.stderr[-2000:]}")
    with open(out / "metrics.jsonl") as f:
        (epoch,) = [r for r in map(json.loads, f) if r["event"] == "epoch"]
    return epoch["clips_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    p.add_argument("--clips", type=int, default=96, help="clips in the synthetic training split")
    p.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
    a = p.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="bench-threads-"))
    data = work / "data"
    if not (data / "manifest.json").exists():
        make_shardset(str(data), {"train": a.clips}, per_shard=8, frames=8)
    figures = {"capped": [], "uncapped": []}
    try:
        for i in range(a.repeats):
            for name in (("capped", "uncapped") if i % 2 == 0 else ("uncapped", "capped")):
                figures[name].append(run(data, work / name, name == "capped"))
                print(json.dumps({"variant": name, "repeat": i, "clips_per_s": round(figures[name][-1], 2),
                                  "load": round(os.getloadavg()[0], 1)}), flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)
    capped, uncapped = (statistics.median(figures[k]) for k in ("capped", "uncapped"))
    print(json.dumps({"cores": len(os.sched_getaffinity(0)), "capped_median": round(capped, 2),
                      "uncapped_median": round(uncapped, 2), "ratio": round(capped / uncapped, 1)}))


if __name__ == "__main__":
    main()
