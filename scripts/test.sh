#!/usr/bin/env bash
# The test command: sets up whatever is missing (fast when already set up), then runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian's nginx, only for the tests and bench/service.py (a caching proxy in front of the service,
# and the reference static server); each starts its own on loopback, never the system's service
if [ ! -x /usr/sbin/nginx ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nginx-light >/dev/null
fi
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # keep every Ray on 127.0.0.1 (../shared/notes/loopback.md)
# Two pytest processes (KF_TEST_WORKERS; 0: one), each test file whole in one of them: much of
# the suite waits on launches, rendezvous and timeouts, which the other process fills.
exec .venv/bin/python -m pytest -q -n "${KF_TEST_WORKERS:-2}" --dist loadfile "$@"
