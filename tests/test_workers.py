"""``ClipLoader``'s worker processes (``trainer.data.workers``), seen from the operating system: the same
processes serve every epoch; a worker killed between epochs, another worker count, an epoch left early
each get new workers and the batches the planner says, every clip once."""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time

import pytest
from helpers.shardsets import make_shardset

from trainer.data import ClipLoader, EpochOptions

CLIPS, BATCH = 24, 2


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("workers"))
    make_shardset(d, {"train": CLIPS}, per_shard=6, frames=2)
    return d


def loader(shardset, workers: int, epoch: int = 0) -> ClipLoader:
    return ClipLoader(shardset, "train", EpochOptions(batch_size=BATCH, seed=4, shuffle_buffer=6,
                                                      epoch=epoch),
                      num_workers=workers, crop_size=32, scale_size=40)


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def epoch_of(ld: ClipLoader, before: set[int]) -> tuple[list[list[str]], set[int]]:
    """One epoch's keys, and this process's children that were not there ``before``, seen mid-epoch."""
    keys, seen = [], set()
    for batch in ld:
        keys.append(batch["keys"])
        seen |= children() - before
    return keys, seen


def test_the_same_worker_processes_serve_every_epoch(shardset):
    before = children()
    ld = loader(shardset, 2)
    epochs = [epoch_of(ld, before) for _ in range(3)]
    pids = [seen for _, seen in epochs]
    assert len(pids[0]) == 2 and pids[0] == pids[1] == pids[2], pids
    assert children() - before == pids[0]  # idle between epochs, not ended
    fresh = loader(shardset, 2)
    assert [keys for keys, _ in epochs] == [epoch_of(fresh, before)[0] for _ in range(3)]


def test_a_worker_killed_between_epochs_is_replaced(shardset, caplog):
    before = children()
    ld = loader(shardset, 2)
    first, pids = epoch_of(ld, before)
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    while victim in children():  # (active_children reaps it)
        time.sleep(0.05)
    time.sleep(0.5)  # the SIGCHLD has come: torch would raise it here if it still watched the idle workers
    with caplog.at_level(logging.WARNING, logger="trainer.data.workers"):
        second, new = epoch_of(ld, before)
    assert f"loader worker(s) {victim} gone between epochs (exit code -9)" in caplog.text
    assert len(new) == 2 and victim not in new and not new & pids
    assert second == epoch_of(loader(shardset, 2, epoch=1), before)[0]


def test_another_worker_count_between_epochs_reads_the_next_epoch_as_a_loader_of_that_many(shardset):
    before = children()
    ld = loader(shardset, 2)
    _, pids = epoch_of(ld, before)
    ld.num_workers = 1
    second, new = epoch_of(ld, before)
    assert len(new) == 1 and not new & pids
    assert second == epoch_of(loader(shardset, 1, epoch=1), before)[0]


def test_an_epoch_left_early_ends_its_workers_and_the_rest_is_read_once_by_new_ones(shardset):
    before = children()
    ld = loader(shardset, 2)
    batches = iter(ld)
    keys = [next(batches)["keys"] for _ in range(3)]
    batches.close()
    assert children() - before == set()  # they might have been writing batches nobody takes
    ld.num_workers = 1  # and the rest of the epoch split anew among one
    rest, _ = epoch_of(ld, before)
    clips = [k for batch in keys + rest for k in batch]
    assert len(clips) == len(set(clips)) == CLIPS
