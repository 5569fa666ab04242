"""Test launcher: ``python tests/helpers/faultrun.py train ...`` is ``trainer train ...`` plus a real signal
sent at an exact point of the run, and each rank's exit code.

The fault is set by the environment, so that it reaches every rank through horovodrun:

    FAULT="<point>:<n>:<signal>:<target>[,<point>:<n>:<signal>:<target>...]" [FAULT_RANK=r (default 0)]

* point ``step``: as this process's n-th training step starts, so the signal lands mid-step
  (the loop sees it after that step); ``validation``: as its n-th validation batch is scored;
  ``validated``: once its n-th whole validation is done.
* signal ``TERM`` or ``INT`` (or ``STOP``: the job held, for a harness to act on and let go with SIGCONT).
* target ``self`` (this rank), ``group`` (its process group: the rank and its loader workers, as
  ``kill -TERM -PGID`` or Ctrl-C in a terminal), ``job`` (every process of the horovodrun job:
  horovodrun, its helpers, every rank and every loader worker, as Slurm's ``scancel`` and time
  limit signal every process of a job), ``launcher`` (horovodrun alone), ``terminal`` (horovodrun's
  process group: what Ctrl-C in the terminal that started it reaches; Horovod's helpers start
  sessions of their own, so the ranks are not in it). For these two, whose signal reaches this rank only
  when horovodrun passes one on, the step waits (up to ``RELAY_WAIT`` seconds) until this rank has it:
  on a loaded machine the relay can take longer than a step, and the rank would stop a step later.

``EXIT_LOG=<prefix>``: each rank appends ``{"exit": code}`` to ``<prefix>.rank<r>.jsonl`` when the
trainer returns (horovodrun reports a rank's helper's code, not the rank's). The clips of every
step are the trainer's own ``--clip-log`` (``trainer.clip_log``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from trainer import cli, train
from trainer.engine import Engine


def rank() -> int:
    return int(os.environ.get("HOROVOD_RANK", 0))


def launcher() -> psutil.Process:
    p = psutil.Process().parent()
    while p is not None and not any("horovodrun" in part for part in p.cmdline()[:2]):
        p = p.parent()
    assert p is not None, "target job/launcher needs horovodrun"
    return p


RELAY_WAIT = 60.0  # seconds a step waits for horovodrun to pass a launcher's or terminal's signal on
received: list[int] = []  # the stop signals this rank's trainer has taken (``train.StopFlag``)


def record_stop_signals() -> None:
    """Note each signal ``train.StopFlag`` takes, besides what it does with it."""
    handle = train.StopFlag._handle

    def noted(self, signum, frame):
        received.append(signum)
        return handle(self, signum, frame)

    train.StopFlag._handle = noted


def wait_for_relay() -> None:
    """Until horovodrun has passed a signal on to this rank (its handler runs during the sleeps)."""
    deadline = time.monotonic() + RELAY_WAIT
    while not received and time.monotonic() < deadline:
        time.sleep(0.01)


def send(signum: int, target: str) -> None:
    """Signal ``target``, from a ``kill`` process of its own where others are signalled: PyTorch's
    loader workers take a SIGTERM from their own parent for a shutdown and exit quietly, so the
    sender must be outside, as Slurm or a user's ``kill`` is."""
    if target == "self":
        os.kill(os.getpid(), signum)
        return
    if target == "group":
        pids = [f"-{os.getpgrp()}"]  # the kill process is in the group too, and dies of it once sent
    elif target == "launcher":
        pids = [str(launcher().pid)]
    elif target == "terminal":
        pids = [f"-{os.getpgid(launcher().pid)}"]
    elif target == "job":
        top = launcher()
        pids = [str(p.pid) for p in [top, *top.children(recursive=True)]]
    else:
        raise ValueError(target)
    subprocess.run(["kill", "-s", signal.Signals(signum).name, "--", *pids], stderr=subprocess.DEVNULL)


def arm(point: str, n: int, signum: int, target: str) -> None:
    """Wrap the function of ``point`` so that its n-th call signals ``target`` (before it runs,
    or for ``validated`` after)."""
    owner, name = {"step": (Engine, "train_step"), "validation": (Engine, "scores"),
                   "validated": (train, "evaluate")}[point]
    original, calls = getattr(owner, name), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n and point != "validated":
            send(signum, target)
            if target in ("launcher", "terminal"):
                wait_for_relay()
        out = original(*args, **kwargs)
        if calls[0] == n and point == "validated":
            send(signum, target)
        return out

    setattr(owner, name, wrapped)


if __name__ == "__main__":
    record_stop_signals()
    if os.environ.get("FAULT") and rank() == int(os.environ.get("FAULT_RANK", 0)):
        for fault in os.environ["FAULT"].split(","):
            point, n, sig, target = fault.split(":")
            arm(point, int(n), getattr(signal, "SIG" + sig), target)
    code = cli.main(sys.argv[1:])
    if os.environ.get("EXIT_LOG"):
        with open(f"{os.environ['EXIT_LOG']}.rank{rank()}.jsonl", "a") as f:
            f.write(json.dumps({"exit": code}) + "\n")
    sys.exit(code)
