"""The job ``test_metadata_ops`` traces: one epoch of every rank in turn, each with its forked
loader workers, reading local shards, over HTTP from the dataset service, and through the
node-local cache (cold, then warm); then, for comparison, every clip of FRAMES_DIR's frame
folders read as TSM's dataset reads them (``bench/loader.py``'s ``FrameFolders``).

    python tests/helpers/metadata_probe.py SHARDS_DIR DATASET_URL CACHE_DIR FRAMES_DIR \
        WORLD_SIZE WORKERS BATCH

Each phase (``<source>/manifest``, ``<source>/rank<r>``) starts with a marker: ``syscalls.mark``
for the trace, and a request for ``/v1/health?mark=<phase>`` for the service's access log. The
manifest is read once per job and handed to every rank, as ``trainer.data.loader.shared_manifest``
does. Prints each rank's batch count.
"""
from __future__ import annotations

import json
import os
import sys
import urllib.request

from syscalls import mark


def epoch(where: str, phase: str, world: int, workers: int, batch: int, service: str | None = None,
          **kw) -> None:
    from shards.format.manifest import Manifest
    from trainer.data import ClipLoader, EpochOptions

    def start(name: str) -> None:
        mark(f"{phase}/{name}")
        if service:
            urllib.request.urlopen(f"{service}/v1/health?mark={phase}/{name}").read()

    start("manifest")
    manifest = Manifest.load(where)
    for rank in range(world):
        start(f"rank{rank}")
        loader = ClipLoader(manifest, "train", EpochOptions(batch_size=batch, rank=rank, world_size=world,
                                                            shuffle_buffer=4),
                            num_workers=workers, crop_size=32, scale_size=36, **kw)
        print(phase, rank, sum(1 for _ in loader), flush=True)


def frame_folders(frames: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from bench.loader import FrameFolders
    from trainer.data.transforms import TrainTransform

    with open(os.path.join(frames, "rows.json")) as f:
        rows = json.load(f)  # the list file (the TSM dataset's), read before the phase
    dataset = FrameFolders(rows, TrainTransform(32, 36))
    mark("frames")
    print("frames", sum(1 for i in range(len(dataset)) if dataset[i] is not None), flush=True)


def main(shards: str, dataset: str, cache: str, frames: str, *job: str) -> None:
    import trainer.data.loader  # noqa: F401  (imported before the first phase)

    service = dataset.split("/v1/")[0]
    world, workers, batch = map(int, job)
    for source, where, kw in (("local", shards, {}), ("http", dataset, {}),
                              ("cache-cold", dataset, {"cache_dir": cache}),
                              ("cache-warm", dataset, {"cache_dir": cache})):
        epoch(where, source, world, workers, batch, None if source == "local" else service, **kw)
    urllib.request.urlopen(f"{service}/v1/health?mark=end").read()
    frame_folders(frames)
    mark("end")


if __name__ == "__main__":
    main(*sys.argv[1:])
