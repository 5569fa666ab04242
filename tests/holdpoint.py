"""Test launcher: ``python tests/holdpoint.py MODULE:QUALNAME -m PACKAGE ARGS...`` is
``python -m PACKAGE ARGS...`` held at a known point: the first call of ``MODULE:QUALNAME`` (a
function, or a method as ``Class.method``; ``MODULE:QUALNAME@N``: the N-th call) runs, then the
calling thread writes ``held`` to the file descriptor ``HOLD_FD`` names and blocks for good (a
signal's handler may still raise there: Ctrl-C reaches a held process). The process's other
threads go on (a build keeps heartbeating its lease), so a test reads that line (EOF instead if
the process died first) and then acts on a run stopped exactly there, with no race against the
clock: kill it, interrupt it, freeze it, start a rival. ``HOLD_FD``: the write end of a pipe the
test passed (``pass_fds``).
"""
from __future__ import annotations

import functools
import importlib
import os
import runpy
import sys
import threading


def arm(target: str, fd: int) -> None:
    """Wrap ``target`` so that its first (or N-th) call returns into the hold."""
    target, _, nth = target.partition("@")
    nth = int(nth or 1)
    module_name, qualname = target.split(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original, calls = getattr(owner, name), []
    lock = threading.Lock()

    @functools.wraps(original)
    def held(*args, **kwargs):
        out = original(*args, **kwargs)
        with lock:
            calls.append(1)
            now = len(calls) == nth
        if now:
            os.write(fd, b"held\n")
            threading.Event().wait()  # until the test kills the process
        return out

    setattr(owner, name, held)


if __name__ == "__main__":
    target, flag, package, *argv = sys.argv[1:]
    assert flag == "-m", "usage: holdpoint.py MODULE:QUALNAME -m PACKAGE ARGS..."
    arm(target, int(os.environ["HOLD_FD"]))
    sys.argv = [package, *argv]
    runpy.run_module(package, run_name="__main__", alter_sys=True)
