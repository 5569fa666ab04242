"""A ``ClipLoader``'s worker processes, kept from one iteration to the next with its batch slots.

The workers are forked once (``Workers``), after the rank has made its shared-memory batch slots
(``trainer.data.slots``) and opened its local shards (one descriptor each, shared by every worker), and
serve epoch after epoch, as torch's ``DataLoader(persistent_workers=True)``, which runs them, and the peer
loaders (webdataset, LitData, MosaicML streaming) keep theirs: an epoch costs no fork, no new mapping of
the slots, no warming of the decoders again. Each iteration the rank sends every worker its ``Ticket``
(its plan for the rest of the epoch, ``trainer.data.plan``, the batch size and how to decode) through a
queue of its own, pickled with the objects a forked worker already holds sent by reference (the split's
manifest entries, the transform), so a ticket is a few kilobytes whatever the manifest; the worker takes it
when the DataLoader resumes it, which is after it was sent.

Workers serve until they cannot (the loader then ends them, frees the slots they had taken, and forks new
ones at its next iteration):

- an iteration that ended before its last batch was handed out (a refusal, the bad-sample budget spent,
  a caller leaving the loop, a worker that died in it: torch raises the DataLoader's ``RuntimeError``
  naming its pid): its workers may still be writing batches nobody will take;
- a worker that died between iterations (killed, say by the kernel's OOM killer): torch watches only
  the workers of a running iteration here, so the rank is not interrupted; the next iteration finds it
  gone, says so in one log line and starts a new set;
- another worker count (``ClipLoader.num_workers``) or another slot pool (``resize`` to larger batches).

Idle workers end with the loader (garbage collected) or, at the latest, as the rank's process exits
(``_end_all``): they ignore SIGTERM, so multiprocessing's own exit handler would wait on them for ever.
"""
from __future__ import annotations

import atexit
import io
import logging
import os
import pickle
import queue
import signal
import weakref
from dataclasses import dataclass
from multiprocessing import get_context

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils import signal_handling

from shards.io.http_range import Retry
from shards.read.cache import ShardCache

from .plan import WorkerPlan
from .slots import SlotPool
from .stages import Decoding, decode_batch, ordered_samples, refusals_as_batches

log = logging.getLogger(__name__)

# A rank opens the local shards it reads once and its forked workers share the descriptors;
# above this many (small world sizes, where metadata load is no concern) workers open their own.
SHARED_FDS_MAX = 256
# Batches a DataLoader worker works ahead (its prefetch factor); the slot pool has two more per worker.
PREFETCH = 2
WAIT = 5.0  # seconds a worker waits for its ticket between looks at whether its rank is still there


def _leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """A loader worker ignores SIGTERM and SIGINT: the trainer's process takes them, stops at a
    step boundary, checkpoints and then ends its workers. Slurm (``scancel``, the time limit)
    and Ctrl-C signal every process of the job or terminal, and PyTorch's handler in a worker
    dies of SIGTERM, which ends the trainer ("DataLoader worker ... is killed by signal")
    before it can save. A worker whose trainer is gone exits by itself (PyTorch checks its
    parent every 5 s)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass(frozen=True)
class Ticket:
    """One worker's part of an iteration: its plan, the batch size, how batches are decoded."""
    plan: WorkerPlan
    batch_size: int
    how: Decoding


class Mailbox:
    """The rank's tickets to its workers (one queue each; in-process without workers); ``held``: the
    objects both sides hold, which a ticket names by their place in it instead of carrying them."""

    def __init__(self, workers: int, held: list):
        self.held, self.refs = held, {id(obj): i for i, obj in enumerate(held)}
        self.queues = [get_context("fork").Queue() for _ in range(workers)]
        self.parent, self.local = os.getpid(), {}

    def send(self, worker: int, ticket: Ticket) -> None:
        if not self.queues:
            self.local[worker] = ticket
            return
        out = io.BytesIO()
        pickler = pickle.Pickler(out, pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = lambda obj: self.refs.get(id(obj))
        pickler.dump(ticket)
        self.queues[worker].put(out.getvalue())

    def take(self, worker: int) -> Ticket:
        if not self.queues:
            return self.local.pop(worker)
        while True:
            try:
                sent = self.queues[worker].get(timeout=WAIT)
                break
            except queue.Empty:
                if os.getppid() != self.parent:  # the rank is gone
                    raise SystemExit(1) from None
        unpickler = pickle.Unpickler(io.BytesIO(sent))
        unpickler.persistent_load = self.held.__getitem__
        return unpickler.load()


class Streams(IterableDataset):
    """The rank's streams: DataLoader worker i carries out the ticket the mailbox holds for it, its
    ordered samples in batches, decoded (``trainer.data.stages``), each sample parsed as one of ``frames``
    frames and ``motion`` fields (``Manifest.frames``, ``Manifest.motion``)."""

    def __init__(self, mailbox: Mailbox, pool: SlotPool | None, fds: dict[int, int], cache: ShardCache | None,
                 lookahead: int, retry: Retry, frames: int | None, motion: str):
        self.mailbox, self.pool, self.fds, self.cache = mailbox, pool, fds, cache
        self.lookahead, self.retry, self.frames, self.motion = lookahead, retry, frames, motion

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info else 0
        ticket = self.mailbox.take(worker)
        plan, how = ticket.plan, ticket.how
        if not plan.order:
            return iter(())
        batches = wds.DataPipeline(
            lambda: iter(ordered_samples(plan, self.fds, self.cache, self.lookahead, how.skip_bad,
                                         self.retry, self.frames, self.motion)),
            wds.batched(ticket.batch_size, collation_fn=list, partial=False),
            wds.map(lambda samples: decode_batch(samples, plan, how, self.pool, worker)),
        )
        return refusals_as_batches(batches)


_RUNNING: weakref.WeakSet = weakref.WeakSet()  # every process's Workers, ended before it exits


@atexit.register  # (before multiprocessing's own exit handler, which would wait on workers ignoring SIGTERM)
def _end_all() -> None:
    for workers in list(_RUNNING):
        workers.close()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class Workers:
    """``count`` DataLoader workers (none: the rank reads itself) writing into ``pool`` and reading local
    shards through the rank's descriptors ``fds`` (closed with the workers); ``held``: the objects every
    ticket may name (``Mailbox``). Not thread-safe: one iteration at a time (``busy``)."""

    def __init__(self, count: int, held: list, pool: SlotPool | None, fds: dict[int, int],
                 cache: ShardCache | None, lookahead: int, retry: Retry, frames: int | None, motion: str):
        self.count, self.pool, self.busy = count, pool, False
        self.mailbox = Mailbox(count, held)
        streams = Streams(self.mailbox, pool, fds, cache, lookahead, retry, frames, motion)
        self.loader = DataLoader(streams, batch_size=None, num_workers=count,
                                 multiprocessing_context="fork" if count else None,
                                 prefetch_factor=PREFETCH if count else None, persistent_workers=count > 0,
                                 pin_memory=torch.cuda.is_available() and pool is None,
                                 worker_init_fn=_leave_stop_signals_to_the_trainer)
        self._close_fds = weakref.finalize(self, _close_all, list(fds.values()))
        _RUNNING.add(self)

    def _processes(self) -> list:
        return getattr(self.loader._iterator, "_workers", [])  # (torch's iterator, once started)

    def pids(self) -> list[int]:
        return [w.pid for w in self._processes()]

    def serve(self, count: int, pool: SlotPool | None) -> bool:
        """Whether these workers can run the next iteration: as many as asked, writing into ``pool``,
        every one alive (a dead one is said in a log line)."""
        gone = [w for w in self._processes() if not w.is_alive()]
        if gone:
            log.warning("loader worker(s) %s gone between epochs (exit code %s): starting new workers",
                        ", ".join(str(w.pid) for w in gone), ", ".join(str(w.exitcode) for w in gone))
        return not gone and self.count == count and self.pool is pool

    def run(self, tickets: list[Ticket]):
        """Send each worker its ticket; the iteration's batches, in the workers' turns."""
        for worker, ticket in enumerate(tickets):
            self.mailbox.send(worker, ticket)
        self.busy = True
        self._watch(True)
        return iter(self.loader)

    def rest(self) -> None:
        """The iteration ran to its last batch: idle until the next, unwatched (torch's SIGCHLD handler
        would raise a dead idle worker's error wherever the rank is; ``serve`` notices it instead)."""
        self._watch(False)
        self.busy = False

    def _watch(self, on: bool) -> None:
        it = self.loader._iterator
        if it is None or not self.count or getattr(it, "_worker_pids_set", on) == on:
            return
        if on:
            signal_handling._set_worker_pids(id(it), tuple(self.pids()))
        else:
            signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = on

    def close(self) -> None:
        """End the workers (no worker writes a slot any more), free the slots they had taken but not
        delivered, close the descriptors."""
        it = self.loader._iterator
        if it is not None:
            self._watch(True)  # (torch's shutdown forgets the pids it watches)
            it._shutdown_workers()
        if self.pool is not None:
            self.pool.reclaim()
        self._close_fds()
        self.busy = False
