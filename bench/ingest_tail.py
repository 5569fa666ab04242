"""How evenly a local build's decode tasks keep its workers busy to the end.

Runs ``ingest build`` in this process on local worker processes (``runner="local"``) with each
decode task (``staging.decode_batch``) timed in its worker, and prints per build: the tasks, the
decode span (from the build's start to the last task's end), each worker's busy seconds, and the
idle tail: how long before the last task ended the other workers had finished their last one
(a core idle while the build still runs). Run it with another checkout first on ``PYTHONPATH``
to compare task planners (``ingest.build.plan_batches``):

    PYTHONPATH=/tmp/before python bench/ingest_tail.py /tmp/bench-ingest-videos/340x256-30fps-10s-120
    PYTHONPATH=. python bench/ingest_tail.py /tmp/bench-ingest-videos/340x256-30fps-10s-120
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# the checkout on PYTHONPATH decides which ingest runs; this folder's ingest.py would shadow it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from ingest import staging  # noqa: E402
from ingest.build import build  # noqa: E402
from ingest.tasks import local_runtime

_decode_batch = staging.decode_batch


def timed_decode_batch(*args, **kwargs) -> dict:
    """``staging.decode_batch`` with (worker pid, start, end) in its index; forked workers run it."""
    start = time.time()
    index = _decode_batch(*args, **kwargs)
    return {**index, "timed": (os.getpid(), start, time.time())}


def one_build(src: str, workers: int) -> dict:
    timed = []
    result = local_runtime.LocalTasks.result

    def noting(tasks, handle):
        value = result(tasks, handle)
        if isinstance(value[0], dict) and "timed" in value[0]:
            timed.append(value[0]["timed"])
        return value

    out = tempfile.mkdtemp(prefix="bench-tail-")
    local_runtime.LocalTasks.result = noting
    try:
        t0 = time.time()
        build(src, out, workers=workers, runner="local")
    finally:
        local_runtime.LocalTasks.result = result
        shutil.rmtree(out, ignore_errors=True)
    last = {}
    for pid, _, end in timed:
        last[pid] = max(last.get(pid, 0.0), end)
    busy = {pid: sum(e - s for p, s, e in timed if p == pid) for pid in last}
    return {"tasks": len(timed), "span": max(last.values()) - t0,
            "idle_tail": max(last.values()) - min(last.values()), "busy": sorted(busy.values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    staging.decode_batch = timed_decode_batch  # before the pool forks: the workers inherit it
    for _ in range(args.repeats):
        r = one_build(args.src, args.workers)
        print(f"{r['tasks']} decode tasks, span {r['span']:.2f} s, idle tail {r['idle_tail']:.3f} s, busy "
              f"per worker {', '.join(f'{b:.2f}' for b in r['busy'])} s, load {os.getloadavg()[0]:.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
