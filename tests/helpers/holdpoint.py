"""Test launcher: ``python tests/helpers/holdpoint.py MODULE:QUALNAME[@N] -m PACKAGE ARGS...`` is
``python -m PACKAGE ARGS...`` held at a known point: the N-th call (the first without ``@N``) of
``MODULE:QUALNAME`` (a function, or a method as ``Class.method``) runs, then the calling thread
writes ``held`` to the file descriptor ``HOLD_FD`` names and blocks: for good, or, where
``RELEASE_FD`` names a descriptor too, until a line or the end of file can be read from it (then
it goes on); a signal's handler may still raise there (Ctrl-C reaches a held process). The
process's other threads go on (a build keeps heartbeating its lease), so a test reads that line
(EOF instead if the process died first) and then acts on a run stopped exactly there, with no
race against the clock: kill it, interrupt it, freeze it, start a rival, take a node away and let
it go on.
``HOLD_FD``: the write end of a pipe the test passed (``pass_fds``); ``RELEASE_FD``: the read end
of another.

In a Ray task instead: with ``HOLD_ON_NODE`` (a Ray node id) and ``HOLD_MARKER`` (a path) set,
``MODULE:QUALNAME`` is a function the program runs as a Ray task; its first call on that node
writes its worker's pid to the marker file (created exclusively: once per run) and blocks for
good, a task in flight for as long as the test wants (it takes the node away under it); every
other call runs as it is.
"""
from __future__ import annotations

import faulthandler
import functools
import importlib
import os
import runpy
import signal
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


def arm_in_task(target: str, node: str, marker: str) -> None:
    """Replace ``target`` by a task that holds its first call on Ray node ``node``. Defined in
    ``__main__``, the task goes to Ray's workers by value, and finds the original there by name."""
    module_name, name = target.split(":")
    owner = importlib.import_module(module_name)

    def task(*args, **kwargs):
        import ray

        if ray.get_runtime_context().get_node_id() == node:
            try:
                fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                threading.Event().wait()  # until the node goes
        return getattr(importlib.import_module(module_name), name)(*args, **kwargs)

    task.__name__ = name  # the task's name, and its worker's process title
    setattr(owner, name, task)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waited too long asks where it is
    target, flag, package, *argv = sys.argv[1:]
    assert flag == "-m", "usage: holdpoint.py MODULE:QUALNAME[@N] -m PACKAGE ARGS..."
    release = os.environ.get("RELEASE_FD")
    if "HOLD_ON_NODE" in os.environ:
        arm_in_task(target, os.environ["HOLD_ON_NODE"], os.environ["HOLD_MARKER"])
    else:
        arm(target, int(os.environ["HOLD_FD"]), int(release) if release else None)
    sys.argv = [package, *argv]
    runpy.run_module(package, run_name="__main__", alter_sys=True)
