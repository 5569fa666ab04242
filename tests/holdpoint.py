"""Test launcher: ``python tests/holdpoint.py MODULE:QUALNAME[@N] -m PACKAGE ARGS...`` is
``python -m PACKAGE ARGS...`` held at a known point: the N-th call (the first without ``@N``) of
``MODULE:QUALNAME`` (a function, or a method as ``Class.method``) runs, then the calling thread
writes ``held`` to the file descriptor ``HOLD_FD`` names and blocks: for good, or, where
``RELEASE_FD`` names a descriptor too, until a line can be read from it (then it goes on). The
process's other threads go on (a build keeps heartbeating its lease), so a test reads that line
(EOF instead if the process died first) and then acts on a run stopped exactly there, with no
race against the clock: kill it, freeze it, start a rival, take a node away and let it go on.
``HOLD_FD``: the write end of a pipe the test passed (``pass_fds``); ``RELEASE_FD``: the read end
of another.
"""
from __future__ import annotations

import functools
import importlib
import os
import runpy
import sys
import threading


def arm(target: str, fd: int, release: int | None = None) -> None:
    """Wrap ``target`` so that its N-th call returns into the hold."""
    module_name, qualname = target.split(":")
    qualname, _, nth = qualname.partition("@")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original, calls, hold_at = getattr(owner, name), [], int(nth or 1)
    lock = threading.Lock()

    @functools.wraps(original)
    def held(*args, **kwargs):
        out = original(*args, **kwargs)
        with lock:
            calls.append(1)
            here = len(calls) == hold_at
        if here:
            os.write(fd, b"held\n")
            if release is None:
                threading.Event().wait()  # until the test kills the process
            else:
                with os.fdopen(release) as f:
                    f.readline()
        return out

    setattr(owner, name, held)


if __name__ == "__main__":
    target, flag, package, *argv = sys.argv[1:]
    assert flag == "-m", "usage: holdpoint.py MODULE:QUALNAME[@N] -m PACKAGE ARGS..."
    release = os.environ.get("RELEASE_FD")
    arm(target, int(os.environ["HOLD_FD"]), int(release) if release else None)
    sys.argv = [package, *argv]
    runpy.run_module(package, run_name="__main__", alter_sys=True)
