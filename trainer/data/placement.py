"""Where a rank stands in its job, and the manifest its loaders read: what a loader needs of the job
before it reads anything. ``placement``: the rank, world size and ranks per node, as given or from the
job's launcher; ``shared_manifest``: one manifest read per job, broadcast to the other ranks."""
from __future__ import annotations

import os

import torch

from shards.format.manifest import Manifest
from shards.io.http_range import DEFAULT_RETRY, Retry
from shards.read.direct import load_manifest


def shared_manifest(url: str, rank: int, broadcast, direct: str = "never",
                    retry: Retry = DEFAULT_RETRY) -> Manifest:
    """Rank 0 reads the manifest (waiting for a source that is down as ``retry`` says); the others
    receive it via ``broadcast(obj, root_rank)``, e.g. ``horovod.torch.broadcast_object``.
    ``direct``: direct reads (``shards.read.direct``)."""
    return broadcast(load_manifest(url, direct, retry) if rank == 0 else None, 0)


def placement(rank: int | None = None, world_size: int | None = None,
              local_size: int | None = None) -> tuple[int, int, int]:
    """(rank, world size, ranks per node) as given, else from ``torch.distributed`` when it is
    initialised, else from the environment torchrun, Lightning and Slurm launchers set (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), else one process. Ranks per node come from
    ``LOCAL_WORLD_SIZE`` only when the world size was not given either."""
    if world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            found = dist.get_rank(), dist.get_world_size()
        else:
            found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        rank, world_size = found[0] if rank is None else rank, found[1]
        if local_size is None:
            local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return (0 if rank is None else rank), world_size, (1 if local_size is None else local_size)
