"""Session-wide fixtures: one local Ray on loopback for the whole run (it costs seconds to start);
always a new one (address="local"), never another Ray running on the machine."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray 2.60 turns on token authentication for a new local cluster by default, and processes that
# join one (`ingest build --address`) disagree about it when they read the token differently;
# every Ray of the tests lives on 127.0.0.1 and is reached by the tests alone.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=150 * 2**20,
             logging_level="WARNING")
    yield ray
    ray.shutdown()
