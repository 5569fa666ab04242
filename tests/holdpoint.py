"""Test launcher: ``python tests/holdpoint.py MODULE:QUALNAME -m PACKAGE ARGS...`` is
``python -m PACKAGE ARGS...`` held at a known point: the first call of ``MODULE:QUALNAME`` (a
function, or a method as ``Class.method``; the ``HOLD_AT``-th call where that is set) runs, then the
calling thread writes ``held`` to the file descriptor ``HOLD_FD`` names and blocks for good. The process's other threads go on (a build
keeps heartbeating its lease), so a test reads that line (EOF instead if the process died first)
and then acts on a run stopped exactly there, with no race against the clock: kill it, freeze it,
start a rival. ``HOLD_FD``: the write end of a pipe the test passed (``pass_fds``).
"""
from __future__ import annotations

import functools
import importlib
import os
import runpy
import sys
import threading


def arm(target: str, fd: int, nth: int = 1) -> None:
    """Wrap ``target`` so that its ``nth`` call returns into the hold."""
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
            this = len(calls) == nth
        if this:
            os.write(fd, b"held\n")
            threading.Event().wait()  # until the test kills the process
        return out

    setattr(owner, name, held)


if __name__ == "__main__":
    target, flag, package, *argv = sys.argv[1:]
    assert flag == "-m", "usage: holdpoint.py MODULE:QUALNAME -m PACKAGE ARGS..."
    arm(target, int(os.environ["HOLD_FD"]), int(os.environ.get("HOLD_AT", 1)))
    sys.argv = [package, *argv]
    runpy.run_module(package, run_name="__main__", alter_sys=True)
