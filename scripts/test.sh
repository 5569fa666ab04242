#!/usr/bin/env bash
# The test command: sets up whatever is missing (fast when already set up), then runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # keep every Ray on 127.0.0.1 (../shared/notes/loopback.md)
exec .venv/bin/python -m pytest -q "$@"
