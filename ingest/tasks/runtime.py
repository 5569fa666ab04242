"""Where a build's tasks run: on Ray, or in processes of this machine without Ray.

``start`` gives the build a ``Tasks`` object (``submit``, ``wait``, ``result``, ``in_flight``,
``close``), the same for both, so that both run the same task functions (``staging``'s) on the
same arguments and write the same bytes:

* ``ray_runtime.RayTasks``: the Ray cluster at ``--address``, the Ray this process already runs,
  or, for a build of more than ``LOCAL_MAX_VIDEOS`` videos, an embedded Ray started for it;
* ``local_runtime.LocalTasks``: otherwise, a pool of worker processes forked from this one.

Without Ray a small build starts in milliseconds instead of seconds: an embedded Ray starts a
GCS server, a raylet, its agents and a Python worker per CPU that imports Ray again, about 5 s of
CPU before the first video is decoded (``bench/ingest.py --startup``), which a build of 16 small
videos spends less than 1 s of CPU on. Above ``LOCAL_MAX_VIDEOS`` that start-up is a few percent
of the build at most, and Ray is used as before. Ray is imported only to use it.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Protocol

RUNNERS = ("auto", "local", "ray")
LOCAL_MAX_VIDEOS = 1000  # above: Ray's start-up (about 5 CPU s) is at most a few percent of the build


class Tasks(Protocol):
    parallel: int  # tasks that run at once

    def submit(self, fn: Callable, *args) -> Any:
        """Start ``fn(*args)`` (a module-level function); -> its handle."""

    def wait(self, handles: Iterable) -> list:
        """The handles among ``handles`` that are done (at least one; blocks until then)."""

    def result(self, handle) -> tuple[Any, str]:
        """(``fn``'s result, the node that ran it); a ``CommandError`` the task raised is raised as itself."""

    def in_flight(self, handles):
        """Context manager: should the caller stop inside it, the tasks of ``handles`` are cancelled."""

    def close(self) -> None:
        """Stop what ``start`` started for the build (a local pool; Ray stays for the process)."""


def start(address: str | None, workers: int | None, videos: int, runner: str = "auto") -> Tasks:
    """The tasks of a build of ``videos`` videos: ``runner`` ``"ray"``, ``"local"``, or ``"auto"``
    (module docstring)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, not {runner!r}")
    if runner == "local" and address:
        raise ValueError("runner 'local' runs on this machine: it cannot join a Ray cluster at an address")
    if runner == "auto":
        runner = "ray" if address or videos > LOCAL_MAX_VIDEOS or _ray_running() else "local"
    if runner == "ray":
        from .ray_runtime import RayTasks  # imports Ray: about 0.5 s of a small build's start

        return RayTasks(address, workers)
    from .local_runtime import LocalTasks

    return LocalTasks(workers)


def _ray_running() -> bool:
    """Whether this process has already started or joined Ray (then its tasks go there, as before)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
