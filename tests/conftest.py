"""Session-wide fixtures: one local Ray on loopback for the whole run (it costs seconds to start)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def ray_local():
    import ray

    # address="local": our own Ray even while another session's `ray start` cluster is up
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=150 * 2**20,
             logging_level="WARNING")
    yield ray
    ray.shutdown()
