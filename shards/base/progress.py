"""Progress of a long loop, in the form that suits where it goes: a live bar on a terminal, lines
in a log.

* On a terminal (the stream is a TTY): a tqdm bar, redrawn in place.
* Anywhere else (a file, a pipe, ``horovodrun``'s capture of each rank's output, a service's
  journal): a line every ``$KF_PROGRESS_SECONDS`` seconds (default ``EVERY``), with done of
  total, percent, rate and ETA, and one last line when the loop ends (its time and mean rate),
  so that a log holds a few lines per epoch, not one per refresh:

      decode: 120/400 videos (30%), 12.3 videos/s, ETA 0:00:23; failed 1
      decode: 400/400 videos in 0:00:31, 12.9 videos/s; failed 1

Messages never land on the bar's line: ``console_handler``, the log handler every console script
uses (``shards.base.commands``), begins each record on a terminal by clearing the line, and redraws
the bars of its own process after it (a loader worker's message, in a process of its own, just
clears the line; the bar comes back at its next update). Used by ``ingest synth`` and ``build``
and by the trainer's epochs.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import weakref

from .words import printable

EVERY = 30.0  # seconds between progress lines when not on a terminal
ENV_EVERY = "KF_PROGRESS_SECONDS"
CLEAR_LINE = "\r\x1b[K"  # carriage return, erase to the end of the line (ECMA-48 EL)
_LIVE: weakref.WeakSet = weakref.WeakSet()  # bars drawn on a terminal by this process, for console_handler


def on_terminal(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def duration(seconds: float) -> str:
    """0:00:23, 1:02:03: as tqdm shows elapsed time and ETA."""
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """``total`` items of ``unit``, ``initial`` of them done before; ``update(n, **figures)`` after
    each piece of work (figures: what the bar shows beside the count, e.g. ``failed=2``);
    ``close()`` (or the ``with`` block's end) at the loop's end. ``enabled=False``: nothing shown
    (ranks other than 0). ``leave``: a terminal bar stays after the end (else it is cleared)."""

    def __init__(self, total: int, *, desc: str, unit: str, initial: int = 0, stream=None,
                 enabled: bool = True, leave: bool = True, every: float | None = None, clock=time.monotonic):
        self.total, self.desc, self.unit, self.n, self.initial = total, desc, unit, initial, initial
        self.stream = stream or sys.stderr
        self.figures: dict = {}
        self.enabled, self.clock, self.pid = enabled, clock, os.getpid()
        self.every = every if every is not None else float(os.environ.get(ENV_EVERY) or EVERY)
        self.started = self.last = clock()
        self.bar = None
        if enabled and on_terminal(self.stream):
            from tqdm import tqdm  # only for a terminal (the console scripts' --help does without it)

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.stream, leave=leave,
                            dynamic_ncols=True, mininterval=0.5, smoothing=0.1)
            _LIVE.add(self)
        self.closed = False

    def update(self, n: int = 1, **figures) -> None:
        self.n += n
        self.figures.update(figures)
        if self.bar is not None:
            self.bar.set_postfix(self.figures, refresh=False)
            self.bar.update(n)
        elif self.enabled and self.clock() - self.last >= self.every and self.n < self.total:
            self.last = self.clock()
            self._line(self.line())

    def line(self) -> str:
        """Where the loop stands, in one line: done of total, percent, rate, ETA, the figures."""
        rate = self._rate()
        eta = f", ETA {duration((self.total - self.n) / rate)}" if rate > 0 else ""
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        return (f"{self.desc}: {self.n:,}/{self.total:,} {self.unit}s{share}, {rate:.3g} {self.unit}s/s{eta}"
                f"{self._figures()}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            _LIVE.discard(self)
            self.bar.close()
        elif self.enabled:
            ended = "in" if self.n >= self.total else f"stopped at {self.n:,}/{self.total:,} after"
            done = f"{self.n:,}/{self.total:,} {self.unit}s in" if self.n >= self.total else ended
            self._line(f"{self.desc}: {done} {duration(self.clock() - self.started)}, "
                       f"{self._rate():.3g} {self.unit}s/s{self._figures()}")

    def _rate(self) -> float:
        elapsed = self.clock() - self.started
        return (self.n - self.initial) / elapsed if elapsed > 0 else 0.0

    def _figures(self) -> str:
        return "; " + ", ".join(f"{k} {v}" for k, v in self.figures.items()) if self.figures else ""

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Console(logging.StreamHandler):
    """A log record on a line of its own: on a terminal the line is cleared first (a bar may be
    drawn there), and this process's live bars are drawn again after it. The record's string
    arguments (the names in ``log.warning("failed: %s", path)``) are printed escaped
    (``shards.base.words.printable``): a file name cannot clear the screen or forge a log line."""

    def format(self, record: logging.LogRecord) -> str:
        if isinstance(record.args, tuple) and record.args:
            record = logging.makeLogRecord({**record.__dict__, "args": tuple(
                printable(a) if isinstance(a, str) else a for a in record.args)})
        return super().format(record)

    def emit(self, record: logging.LogRecord) -> None:
        if not on_terminal(self.stream):
            return super().emit(record)
        self.stream.write(CLEAR_LINE)
        super().emit(record)
        for progress in list(_LIVE):
            if progress.pid == os.getpid() and progress.stream is self.stream:
                progress.bar.refresh()


def console_handler(stream=None) -> logging.Handler:
    """The log handler of the console scripts: ``stream`` (default stderr), records never on a bar's line."""
    return _Console(stream or sys.stderr)
