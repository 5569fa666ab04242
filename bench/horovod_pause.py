"""How long one rank may pause (blocked in a data read, waiting out a source's outage) while the
others wait in an allreduce, before Horovod turns the pause into a crash.

Two ranks (horovodrun -np 2 --gloo on 127.0.0.1): rank 0 enters a CPU allreduce at once, as a
trainer rank does with its stop flags after a step; rank 1 sleeps PAUSE seconds first, as a rank
whose loader waits for its source does, then joins it. Each pause runs as its own job under the
given Horovod settings (environment ``KEY=VALUE`` pairs), and one JSON line per pause says whether
the allreduce completed, how long rank 0 waited in it, horovodrun's exit status and the lines
Horovod wrote meanwhile (its stall warnings), counted.

    PYTHONPATH=. python bench/horovod_pause.py --pauses 40 130 [--env HOROVOD_GLOO_TIMEOUT_SECONDS=10 ...]
    PYTHONPATH=. python bench/horovod_pause.py --pauses 40 130 --backend torch [--torch-timeout 20]  #
    torchrun, Gloo
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def rank_main(pause: float, backend: str, timeout: float | None) -> None:
    """One rank of the job: rank 1 pauses, then both allreduce; rank 0 prints what it saw."""
    import torch

    if backend == "horovod":
        import horovod.torch as hvd
        hvd.init()
        rank, allreduce = hvd.rank(), (lambda t: hvd.allreduce(t, op=hvd.Sum))
    else:
        import datetime

        import torch.distributed as dist
        dist.init_process_group("gloo", **({"timeout": datetime.timedelta(seconds=timeout)} if timeout
                                           else {}))
        rank = dist.get_rank()

        def allreduce(t):
            dist.all_reduce(t)
            return t
    allreduce(torch.ones(1))  # both up and connected
    if rank == 1:
        time.sleep(pause)
    began = time.monotonic()
    try:
        total = allreduce(torch.ones(2)).tolist()
        outcome = {"completed": total == [2.0, 2.0]}
    except Exception as e:  # noqa: BLE001 -- what breaks is the measurement
        outcome = {"completed": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    if rank == 0:
        print("RESULT " + json.dumps({**outcome, "rank0_waited_s": round(time.monotonic() - began, 1)}),
              flush=True)
    if backend != "horovod":
        dist.destroy_process_group()


def job(pause: float, env: dict, backend: str, timeout: float | None) -> dict:
    me = [sys.executable, __file__, "--rank-main", str(pause), "--backend", backend,
          *(["--torch-timeout", str(timeout)] if timeout else [])]
    if backend == "horovod":
        launch = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", *me]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launch = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(port), *me[1:]]  # (torchrun runs the script with its own Python)
    began = time.monotonic()
    p = subprocess.run(launch, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                       text=True, timeout=pause + 900)
    out = p.stdout + p.stderr
    result = next((json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line),
                  {"completed": False})
    # Horovod's stall check: "One or more tensors were submitted ... waiting for remainder of ranks for
    # more than 60 seconds. ... Missing ranks: ..." (HOROVOD_STALL_CHECK_TIME_SECONDS)
    warnings = [line for line in out.splitlines() if "remainder of ranks" in line or "Missing ranks" in line]
    return {"backend": backend, "pause_s": pause, "env": env, "torch_timeout_s": timeout, **result,
            "exit": p.returncode,
            "wall_s": round(time.monotonic() - began, 1), "stall_warning_lines": len(warnings),
            "first_warning": warnings[0][:200] if warnings else None,
            "tail": None if result.get("completed") else out[-600:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pauses", type=float, nargs="+", default=[40.0, 130.0])
    p.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--backend", choices=("horovod", "torch"), default="horovod")
    p.add_argument("--torch-timeout", type=float,
                   help="init_process_group's timeout (default: PyTorch's, 30 min)")
    p.add_argument("--rank-main", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main is not None:
        rank_main(args.rank_main, args.backend, args.torch_timeout)
        return
    env = dict(kv.split("=", 1) for kv in args.env)
    for pause in args.pauses:
        print(json.dumps(job(pause, env, args.backend, args.torch_timeout)), flush=True)


if __name__ == "__main__":
    main()
