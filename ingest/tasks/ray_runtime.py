"""Starting or joining Ray for a build: an embedded local Ray on loopback by default,
an existing cluster with ``--address`` (``auto``: the one RAY_ADDRESS names or a ``ray start`` on
this machine joined); ``RayTasks``: a build's tasks on it (``ingest.tasks.runtime``)."""
from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager

import ray

from shards.base.errors import CommandError
from shards.base.words import plural

from .ray_address import check_reachable

log = logging.getLogger("ingest.ray")


def start(address: str | None, workers: int | None, object_store_mb: int = 512) -> None:
    """Connect to Ray (reusing one already started in this process); log its CPUs and the tasks at a time."""
    if not ray.is_initialized():
        if not sys.stderr.isatty():  # worker log lines forwarded without colour codes into log files
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        if address:
            check_reachable(address)
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        else:
            # Keeps a single-machine Ray on 127.0.0.1 instead of the machine's network address.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            # A Ray of our own on loopback: no token to set up, and no warning about it per build.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            # "local": always a Ray of our own. Without it ray.init() joins whatever cluster a
            # `ray start` on this machine last recorded (or RAY_ADDRESS names).
            ray.init(address="local", num_cpus=workers or os.cpu_count(), include_dashboard=False,
                     object_store_memory=object_store_mb * 2**20, logging_level=logging.WARNING)
    cpus, parallel = tasks_at_a_time(workers)
    log.info("Ray: %s in the cluster, %s at a time", plural(cpus, "CPU"), plural(parallel, "task"))


def tasks_at_a_time(workers: int | None) -> tuple[int, int]:
    """(the cluster's CPUs as they are now, the tasks to run at a time: those CPUs, at most ``workers``)."""
    cpus = int(ray.cluster_resources().get("CPU", 1))
    return cpus, max(1, min(workers, cpus) if workers else cpus)


def task(fn):
    """``fn`` as a build task: ``task(fn)(*args)`` submits it and returns its reference. One CPU,
    retried twice when its worker or node dies, spread over the cluster's nodes (Ray would
    otherwise pack short tasks onto the node whose workers are already warm, leaving new nodes
    idle), named after ``fn`` (the worker's process title, ``ray::decode_batch``). Its result is
    ``(fn's result, node id)``, see ``on_node``."""
    remote = ray.remote(num_cpus=1, max_retries=2, scheduling_strategy="SPREAD")(on_node)
    named = remote.options(name=fn.__name__)
    return lambda *args: named.remote(fn, *args)


def on_node(fn, *args):
    """Run ``fn(*args)`` as a Ray task; -> (its result, the id of the node that ran it), so a build
    can say how the work spread over the cluster's nodes."""
    return fn(*args), ray.get_runtime_context().get_node_id()


def result(ref):
    """``ray.get(ref)``, with a refusal the task raised (a ``CommandError``, such as a full disk's
    ``NoSpace``) raised here as itself: its one line, not Ray's error with the worker's traceback."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, CommandError):
            raise e.cause from None
        raise


@contextmanager
def in_flight(refs):
    """Around the driver's wait for the tasks of ``refs`` (a list, or a dict it keeps up to date):
    should the driver stop, the tasks still running are waited for, so that nothing is left
    half-written behind it and Ray reports no error left unread. On Ctrl-C they are cancelled first
    (a KeyboardInterrupt in each, so a write under way removes its temporary file; Ray's cancel is
    best effort, ray-project/ray#32954: a task it does not interrupt ends on its own); on any other
    stop (a task's refusal, such as a full disk's) they are let finish: cancelling a task whose
    result is arriving aborts the driver in Ray 2.60 ("Check failed: it != submissible_tasks_.end()",
    ray-project/ray#54846; it took a pytest worker down in the full-disk test), and a task on a
    full disk fails at its first write anyway. Only the tasks not yet finished are cancelled."""
    try:
        yield
    except BaseException as stop:
        left = list(refs)
        if isinstance(stop, KeyboardInterrupt) and left:
            _, running = ray.wait(left, num_returns=len(left), timeout=0)
            for ref in running:
                ray.cancel(ref)
        for ref in left:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                pass
        raise


class RayTasks:
    """A build's tasks as Ray tasks (``task``), on the cluster ``start`` connects to."""

    def __init__(self, address: str | None, workers: int | None):
        start(address, workers)
        self._workers = workers
        self._remote = {}

    @property
    def parallel(self) -> int:
        """Tasks at a time: the cluster's CPUs as they are now, so that a node that joins during
        the build (an autoscaler's, or one still registering when the build began) gets tasks; at
        most ``workers``."""
        return tasks_at_a_time(self._workers)[1]

    def submit(self, fn, *args):
        if fn not in self._remote:
            self._remote[fn] = task(fn)
        return self._remote[fn](*args)

    def wait(self, handles) -> list:
        ready, _ = ray.wait(list(handles), num_returns=1)
        return ready

    def result(self, handle):
        return result(handle)

    def in_flight(self, handles):
        return in_flight(handles)

    def close(self) -> None:
        """Ray stays up for the process: the next build in it reuses it."""
