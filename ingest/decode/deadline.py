"""One video's time budget (``ingest build --timeout``), shared by every external call it makes.

A video gets ``--timeout`` seconds for everything: download, probe, decode, frame count. Each
call is given what is left:

* subprocesses (ffprobe, the ffmpeg CLI) get the remaining seconds as their ``timeout`` and are
  killed when it runs out;
* in-process work (fsspec downloads, PyAV demuxing and decoding through a Python file object)
  runs with ``SIGALRM`` armed for the remaining time: its handler raises ``TimedOut`` in the main
  thread, which also ends a system call blocked on a pipe or socket (PEP 475 retries an
  interrupted call only when the handler returns). Ray runs tasks in the worker's main thread.
  Off the main thread no signal can be used, and the deadline is only checked between steps.

What timed out is named in the error (``timed out after 30 s (downloading)``) for the ledger.
"""
from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager


class TimedOut(Exception):
    """The video's deadline passed; ``step`` says what it was doing."""

    def __init__(self, seconds: float, step: str):
        super().__init__(f"timed out after {seconds:g} s ({step})")
        self.seconds, self.step = seconds, step


class Deadline:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.step = "starting"

    def remaining(self, step: str | None = None) -> float:
        """Seconds left (> 0) for ``step``; raises ``TimedOut`` when none are."""
        if step:
            self.step = step
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimedOut(self.seconds, self.step)
        return left

    def check(self, step: str | None = None) -> None:
        self.remaining(step)

    @contextmanager
    def armed(self, step: str):
        """Run the block under this deadline: ``TimedOut`` is raised inside it when time runs out,
        even from a blocked system call (main thread only; elsewhere only checked on entry)."""
        left = self.remaining(step)
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def expire(signum, frame):
            raise TimedOut(self.seconds, self.step)

        previous = signal.signal(signal.SIGALRM, expire)
        # Fires again every half second after the deadline, should library code swallow the first.
        signal.setitimer(signal.ITIMER_REAL, left, 0.5)
        try:
            yield self
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
