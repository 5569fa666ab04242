"""CPU seconds of whole process trees, for benchmarks on a shared machine.

Wall time on a loaded machine says more about the other jobs than about the code; the CPU
seconds of everything a run started do not (much). ``run`` times a command in a fresh process
and counts the CPU of all it started, daemons included: this process adopts orphans
(``adopt_orphans``, Linux's child subreaper), so what a command leaves behind (Ray's GCS and
raylet, a pool's workers) is reparented here and waited for, and its CPU is counted.
``tree_cpu`` is the CPU so far of this process and everything below it, for work done in it.
"""
from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import time

import psutil

_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def tree_cpu() -> float:
    """CPU seconds of this process, its waited-for children and its live descendants (with theirs)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    total = me.ru_utime + me.ru_stime + _children_cpu()
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def run(cmd: list[str], cwd: str | None = None) -> dict:
    """Run ``cmd`` to its end; -> {"seconds": its wall time, "cpu": the CPU seconds of it and of
    every process it started, waited for after it exits}. Needs ``adopt_orphans`` first."""
    known = {p.pid for p in psutil.Process().children()}
    before, t0 = _children_cpu(), time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    while left := [p.pid for p in psutil.Process().children() if p.pid not in known]:
        for pid in left:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    return {"seconds": seconds, "cpu": _children_cpu() - before}
