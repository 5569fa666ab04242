"""What a training fault costs: a tiny run broken at a fixed step by a real signal or SIGKILL
(``tests/helpers/faultrun.py``) and resumed, against the same run unbroken.

Prints one JSON line per case: for each process, its wall and CPU seconds (user + system of the
process and its children; not for horovodrun cases whose helpers a signal orphans), exit code and
the checkpoint's (epoch, batch, step) when it ended; steps trained again are the step the fault
hit minus the checkpoint's step. The ``restart`` cases resume a finished run: start-up and exit,
nothing trained, i.e. what every restart costs.

    PYTHONPATH=. python bench/faults.py [CASE ...] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.shardsets import make_shardset  # noqa: E402

FAULTRUN = str(ROOT / "tests" / "helpers" / "faultrun.py")
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
# 96 clips, 4 per rank: 24 steps per epoch on 1 rank, 12 on 2; 2 epochs
FLAGS = ["--segments", "4", "--depth", "10", "--width", "8", "--crop-size", "32", "--scale-size", "36",
         "--batch-size", "4", "--epochs", "2", "--workers", "2", "--print-freq", "1", "--no-tensorboard"]
RESUME = ("--resume",)
# case -> (ranks, [(fault, rank the fault is armed on, extra flags), ...]: one process each)
CASES = {
    "straight-1": (1, [("", 0, ())]),
    "term-group-mid": (1, [("step:30:TERM:group", 0, ()), ("", 0, RESUME)]),
    "term-last-step": (1, [("step:24:TERM:self", 0, ()), ("", 0, RESUME)]),
    "kill-checkpoint-steps-10": (1, [("step:40:KILL:group", 0, ("--checkpoint-steps", "10")),
                                     ("", 0, (*RESUME, "--checkpoint-steps", "10"))]),
    "kill-epoch-checkpoints": (1, [("step:40:KILL:group", 0, ()), ("", 0, RESUME)]),
    "restart-1": (1, [("", 0, RESUME)]),
    "straight-2": (2, [("", 0, ())]),
    "term-one-rank": (2, [("step:6:TERM:self", 1, ()), ("", 0, RESUME)]),
    "term-job": (2, [("step:6:TERM:job", 0, ()), ("", 0, RESUME)]),
    "term-launcher": (2, [("step:6:TERM:launcher", 0, ()), ("", 0, RESUME)]),
    "restart-2": (2, [("", 0, RESUME)]),
}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(data: Path, out: Path, ranks: int, fault: str, fault_rank: int, extra) -> dict:
    launch = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo"] if ranks == 2 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT": fault, "FAULT_RANK": str(fault_rank)}
    wall, cpu = time.perf_counter(), cpu_seconds()
    proc = subprocess.run([*launch, sys.executable, FAULTRUN, "train", "--data", str(data), "--output-dir",
                           str(out), *(["--backend", "none"] if ranks == 1 else []), *FLAGS, *extra],
                          env=env, capture_output=True, start_new_session=True)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True) if (out / "checkpoint.pt").exists() else None
    return {"fault": fault, "wall_s": round(wall, 1), "cpu_s": None if ranks == 2 else round(cpu, 1),
            "exit": proc.returncode, "checkpoint": ckpt and [ckpt["epoch"], ckpt["batch"], ckpt["step"]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", metavar="CASE", help=f"default: all of {', '.join(CASES)}")
    p.add_argument("--dir", default="/tmp/kinetics-fast-bench-faults", help="data and runs go here")
    args = p.parse_args()
    if set(args.cases) - set(CASES):
        p.error(f"unknown cases {sorted(set(args.cases) - set(CASES))}")
    root = Path(args.dir)
    data = root / "data"
    if not (data / "manifest.json").exists():
        make_shardset(str(data), {"train": 96, "val": 16}, per_shard=8, num_classes=3, frames=4,
                      size=(48, 40))
    for name in args.cases or CASES:
        ranks, parts = CASES[name]
        # restart: resume the finished run
        out = root / (f"straight-{ranks}" if name.startswith("restart") else name)
        if not name.startswith("restart"):
            shutil.rmtree(out, ignore_errors=True)
        runs = [run(data, out, ranks, *part) for part in parts]
        print(json.dumps({"case": name, "runs": runs, "wall_s": round(sum(r["wall_s"] for r in runs), 1),
                          "load": round(os.getloadavg()[0], 1)}), flush=True)


if __name__ == "__main__":
    main()
