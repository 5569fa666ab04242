"""Test launcher: ``python tests/faultrun.py train ...`` is ``trainer train ...`` plus a real signal
sent at an exact point of the run, and a log of the clips each training step got.

The fault is set by the environment, so that it reaches every rank through horovodrun:

    FAULT="<point>:<n>:<signal>:<target>" [FAULT_RANK=r (default 0)]

* point ``step``: after this process's n-th training step, before the loop checks for a stop;
  ``validation``: after its n-th validation batch; ``validated``: after its n-th whole validation.
* signal ``TERM`` or ``INT``.
* target ``self`` (this rank), ``group`` (its process group: the rank and its loader workers, as
  ``kill -TERM -PGID`` or Ctrl-C in a terminal), ``job`` (every process of the horovodrun job:
  horovodrun, its helpers, every rank and every loader worker, as Slurm's ``scancel`` and time
  limit signal every process of a job), ``launcher`` (horovodrun alone).

``CLIP_LOG=<prefix>``: each rank appends ``{"epoch", "clips_seen", "keys", "valid", "global_valid"}``
per training step to ``<prefix>.rank<r>.jsonl`` (``clips_seen`` before the step).
"""
from __future__ import annotations

import json
import os
import signal
import sys

import psutil

from trainer import cli, train
from trainer.engine import Engine
from trainer.loader import ClipLoader


def rank() -> int:
    return int(os.environ.get("HOROVOD_RANK", 0))


def launcher() -> psutil.Process:
    p = psutil.Process().parent()
    while p is not None and not any("horovodrun" in part for part in p.cmdline()[:2]):
        p = p.parent()
    assert p is not None, "target job/launcher needs horovodrun"
    return p


def send(signum: int, target: str) -> None:
    if target == "self":
        os.kill(os.getpid(), signum)
    elif target == "group":
        os.killpg(os.getpgrp(), signum)
    elif target == "launcher":
        launcher().send_signal(signum)
    elif target == "job":
        top = launcher()
        for p in [top, *top.children(recursive=True)]:
            if p.pid != os.getpid():
                p.send_signal(signum)
        os.kill(os.getpid(), signum)
    else:
        raise ValueError(target)


def arm(point: str, n: int, signum: int, target: str) -> None:
    """Wrap the function that ends at ``point`` so that its n-th call signals ``target``."""
    owner, name = {"step": (Engine, "train_step"), "validation": (Engine, "scores"),
                   "validated": (train, "evaluate")}[point]
    original, calls = getattr(owner, name), [0]

    def wrapped(*args, **kwargs):
        out = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == n:
            send(signum, target)
        return out

    setattr(owner, name, wrapped)


def log_clips(prefix: str) -> None:
    original_iter, original_step = ClipLoader.__iter__, Engine.train_step
    path = f"{prefix}.rank{rank()}.jsonl"
    pending = {}

    def logged_iter(self):
        for batch in original_iter(self):
            if self.train:
                pending.update(epoch=self.epoch, keys=batch["keys"], valid=batch["valid"].tolist(),
                               global_valid=batch["global_valid"])
            yield batch

    def logged_step(self, *args, **kwargs):
        record = {"clips_seen": self.clips_seen, **pending}
        out = original_step(self, *args, **kwargs)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return out

    ClipLoader.__iter__, Engine.train_step = logged_iter, logged_step


if __name__ == "__main__":
    if os.environ.get("CLIP_LOG"):
        log_clips(os.environ["CLIP_LOG"])
    if os.environ.get("FAULT") and rank() == int(os.environ.get("FAULT_RANK", 0)):
        point, n, sig, target = os.environ["FAULT"].split(":")
        arm(point, int(n), getattr(signal, "SIG" + sig), target)
    sys.exit(cli.main(sys.argv[1:]))
