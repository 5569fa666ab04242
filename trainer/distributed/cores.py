"""This rank's share of the machine's CPU cores: its intra-op threads and its loader workers.

PyTorch starts as many intra-op threads as the machine has cores in every process, so N ranks on
one machine run N times too many threads and wait on each other (horovodrun -np 2 on 2 cores:
7.7 clips/s against 220 with one thread each). As torchrun does with OMP_NUM_THREADS, each rank
takes the cores it may run on (its affinity) divided by the ranks on the machine, unless
OMP_NUM_THREADS says otherwise. Loader workers default to that share less the core the rank's own
loop runs on, at most 4: more workers than cores only adds switching (and PyTorch's warning).
"""
from __future__ import annotations

import os

import torch

MAX_DEFAULT_WORKERS = 4


def cores_per_rank(local_ranks: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))


def cap_threads(local_ranks: int) -> int | None:
    """Set this process's intra-op threads to its share unless OMP_NUM_THREADS is set; -> the count
    set (None: left as OMP_NUM_THREADS says)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = cores_per_rank(local_ranks)
    torch.set_num_threads(threads)
    return threads


def default_workers(local_ranks: int) -> int:
    """Loader workers per rank when --workers is not given."""
    return min(MAX_DEFAULT_WORKERS, cores_per_rank(local_ranks) - 1)
