"""The program ``test_metadata_ops`` runs under ``strace -f``: one epoch of every rank of a job,
read from local shards, over HTTP, and through the node-local cache (cold, then warm).

    python tests/metadata_probe.py SHARDS_DIR SERVICE_URL CACHE_DIR WORLD_SIZE WORKERS BATCH

Before each phase it stats ``MARK/<phase>`` (a path that does not exist: the marker the trace
is cut at) and, for HTTP phases, asks the service for ``/v1/health?mark=<phase>`` (the marker its
access log is cut at). Each rank's manifest is the one object read once per job, as
``trainer.loader.shared_manifest`` hands it to every rank. Prints each phase's batch count.
"""
from __future__ import annotations

import os
import sys
import time
import urllib.request

MARK = "/.kf-metadata-probe"


def mark(phase: str, service: str | None = None) -> None:
    try:
        os.stat(f"{MARK}/{phase}")
    except FileNotFoundError:
        pass
    if service:
        urllib.request.urlopen(f"{service}/v1/health?mark={phase}").read()


def epoch(where: str, world: int, workers: int, batch: int, phase: str, service: str | None = None,
          **kw) -> None:
    from shards.manifest import Manifest
    from trainer.loader import ClipLoader

    mark(f"{phase}/manifest", service)
    manifest = Manifest.load(where)
    for rank in range(world):
        mark(f"{phase}/rank{rank}", service)
        loader = ClipLoader(manifest, "train", batch_size=batch, rank=rank, world_size=world,
                            num_workers=workers, crop_size=32, scale_size=36, shuffle_buffer=4, **kw)
        t = time.monotonic()
        print(phase, rank, sum(1 for _ in loader), round(time.monotonic() - t, 2), flush=True)


def main(shards: str, service: str, cache: str, world: str, workers: str, batch: str) -> None:
    import trainer.loader  # noqa: F401  (imports before the first marker: nothing to count)

    job = int(world), int(workers), int(batch)
    dataset = f"{service}/v1/datasets/probe"
    epoch(shards, *job, "local")
    epoch(dataset, *job, "http", service)
    epoch(dataset, *job, "cache-cold", service, cache_dir=cache)
    epoch(dataset, *job, "cache-warm", service, cache_dir=cache)
    mark("end", service)


if __name__ == "__main__":
    main(*sys.argv[1:])
