"""Starting or joining Ray for a build: an embedded local Ray on loopback by default,
an existing cluster with ``--address``."""
from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger("ingest.ray")


def start(address: str | None, workers: int | None, object_store_mb: int = 512) -> int:
    """Connect to Ray (reusing one already started in this process); return the task parallelism."""
    if not ray.is_initialized():
        if address:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        else:
            # Keeps a single-machine Ray on 127.0.0.1 instead of the machine's network address.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            # "local": a Ray of our own even when `ray start` left its address in /tmp/ray (ray.init()
            # would join that cluster, and refuse num_cpus); joining one is what --address is for.
            ray.init(address="local", num_cpus=workers or os.cpu_count(), include_dashboard=False,
                     object_store_memory=object_store_mb * 2**20, logging_level=logging.WARNING)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    parallel = min(workers, cpus) if workers else cpus
    log.info("Ray: %d CPUs in the cluster, %d tasks at a time", cpus, parallel)
    return max(1, parallel)
