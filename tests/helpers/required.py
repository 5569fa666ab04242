"""Test helper: the system tools a few tests need (Debian's chromium and chromedriver, nginx, Slurm
and munge, podman with runc and debootstrap, the Prometheus Pushgateway). Where one is missing, such a test
skips saying what to install; where the test command requires it (scripts/test.sh exports
``KF_REQUIRE_<WHAT>``, as CI runs it), the test fails instead, so that no run of the test command passes
without them."""
from __future__ import annotations

import os

import pytest


def require(what: str, missing: str | None) -> None:
    """Go on if ``missing`` is None; else fail where ``$KF_REQUIRE_<WHAT>`` is set, skip elsewhere."""
    if missing is None:
        return
    if os.environ.get(f"KF_REQUIRE_{what.upper()}"):
        pytest.fail(f"{missing} (required here: KF_REQUIRE_{what.upper()} is set)")
    pytest.skip(missing)
