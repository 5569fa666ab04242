"""A build's tasks in worker processes of this machine, without Ray (``ingest.tasks.runtime``).

The workers are forked from the build's process, which has already imported the decoders, so
they start in milliseconds (from a fork server that imports them once when the process runs
other threads, which a fork would copy in whatever state their locks are). What Ray does for a
build, they do too:
* a worker that dies (killed, or crashed in a native library) has its tasks run again in a new
  pool, up to ``RETRIES`` times, as Ray retries a task (the tasks are idempotent: a staged batch
  is found, not decoded again);
* stopping the build (Ctrl-C, a task's ``NoSpace``) cancels the tasks in flight: each worker gets
  SIGTERM, which raises ``Cancelled`` inside a running task, so a write under way removes its
  temporary file, and the worker exits. The workers ignore SIGINT (a terminal sends it to the
  whole process group: the build's process decides), and get SIGTERM when it dies.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_for
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field

from shards.base.errors import CommandError
from shards.base.words import plural

RETRIES = 2  # as the Ray tasks' max_retries
NODE = "local"
PRELOAD = ["ingest.staging"]  # what a fork server imports for its workers
_PR_SET_PDEATHSIG = 1
log = logging.getLogger("ingest.local")


class Cancelled(BaseException):
    """Raised inside a worker's task when the build cancels it."""


class WorkerDied(CommandError):
    """A task whose worker process died on every try."""


_running = False  # in a worker: whether a task is running (SIGTERM cancels it) or not (SIGTERM ends it)


def _cancel(signum, frame):
    if _running:
        raise Cancelled()
    os._exit(128 + signum)


def _worker_start() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _cancel)
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # Linux: ends with the process that forked it


def _run(fn, *args):
    """``fn(*args)`` in a worker; a cancelled task ends the worker once its clean-up has run."""
    global _running
    _running = True
    try:
        return fn(*args)
    except Cancelled:
        os._exit(128 + signal.SIGTERM)
    finally:
        _running = False


@dataclass(eq=False)
class Handle:
    fn: object
    args: tuple
    future: Future = None
    tries: int = 0
    pool: ProcessPoolExecutor | None = field(default=None, repr=False)


class LocalTasks:
    def __init__(self, workers: int | None):
        self.parallel = max(1, workers or os.cpu_count() or 1)
        log.info("%s on this machine, without Ray",
                 plural(self.parallel, "worker process", "worker processes"))
        self._pool: ProcessPoolExecutor | None = None
        self._live: set[Handle] = set()

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            method = "fork" if threading.active_count() == 1 else "forkserver"
            context = multiprocessing.get_context(method)
            if method == "forkserver":
                context.set_forkserver_preload(PRELOAD)
            self._pool = ProcessPoolExecutor(self.parallel, mp_context=context, initializer=_worker_start)
        return self._pool

    def _send(self, handle: Handle) -> None:
        handle.pool = self._executor()
        handle.future = handle.pool.submit(_run, handle.fn, *handle.args)

    def submit(self, fn, *args) -> Handle:
        handle = Handle(fn, args)
        while True:
            try:
                self._send(handle)
                break
            except BrokenProcessPool:
                # a worker died since the last task was sent: a new pool, as in result()
                handle.tries += 1
                if handle.tries > RETRIES:
                    raise WorkerDied(f"{fn.__name__}: the worker processes died on each of {handle.tries} "
                                     "tries to start it (killed, or crashed in a native library)") from None
                self._restart(handle.pool)
        self._live.add(handle)
        return handle

    def wait(self, handles) -> list[Handle]:
        handles = list(handles)
        done, _ = wait_for([h.future for h in handles], return_when=FIRST_COMPLETED)
        return [h for h in handles if h.future in done]

    def result(self, handle: Handle):
        while True:
            try:
                value = handle.future.result()
            except BrokenProcessPool:
                self._restart(handle.pool)
                continue
            self._live.discard(handle)
            return value, NODE

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        """A worker of ``broken`` died: every task that was in it runs again in a new pool."""
        if broken is self._pool:
            self._pool = None
            broken.shutdown(wait=True)
        for h in [h for h in self._live if h.pool is broken]:
            h.tries += 1
            if h.tries > RETRIES:
                raise WorkerDied(f"{h.fn.__name__}: its worker process died on each of {h.tries} tries "
                                 "(killed, or crashed in a native library)")
            self._send(h)

    @contextmanager
    def in_flight(self, handles):
        """Should the caller stop inside it, the workers are stopped: SIGTERM cancels their tasks
        (module docstring), and they are waited for."""
        try:
            yield
        except BaseException:
            self._stop()
            raise

    def _stop(self) -> None:
        pool, self._pool = self._pool, None
        self._live.clear()
        if pool is None:
            return
        processes = list((pool._processes or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        for p in processes:
            p.join()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._live.clear()
