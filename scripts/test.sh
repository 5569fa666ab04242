#!/usr/bin/env bash
# The test command: sets up whatever is missing (fast when already set up), then runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# What only the tests need: a headless browser and its driver for tests/test_viewer_browser.py
# (Debian's chromium and chromium-driver; Selenium comes with the dev extras). Checked first, so
# a second run installs nothing.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # keep every Ray on 127.0.0.1 (../shared/notes/loopback.md)
# Two pytest processes (KF_TEST_WORKERS; 0: one), each test file whole in one of them: much of
# the suite waits on launches, rendezvous and timeouts, which the other process fills.
exec .venv/bin/python -m pytest -q -n "${KF_TEST_WORKERS:-2}" --dist loadfile "$@"
