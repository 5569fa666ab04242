#!/usr/bin/env bash
# The test command: sets up whatever is missing (fast when already set up), then runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# What only the tests need, each checked first so that a second run installs nothing: a headless
# browser and its driver for tests/test_viewer.py (Debian's chromium and chromium-driver;
# Selenium comes with the dev extras); Debian's nginx (tests/test_service_bytes.py's caching proxy
# and bench/service.py's reference server; each starts its own on loopback, never the system's
# service); a one-node Slurm for tests/test_cluster_slurm.py, which runs the Slurm runbook on
# loopback (slurm-wlm and munge: apt-get update + install took 13 s on the development machine);
# and Debian's PostgreSQL server for the catalog tests on PostgreSQL and the service's replicas
# (tests/helpers/postgres.py starts its own with initdb/pg_ctl in a temporary directory, never the system's);
# Debian's Prometheus Pushgateway for tests/test_push_gateway.py (its own on loopback, likewise);
# podman, runc and debootstrap for tests/test_container_images.py, which builds the CPU image on a
# base made from Debian's packages (docs/runbooks/containers.md).
need=()
{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || need+=(chromium chromium-driver)
[ -x /usr/sbin/nginx ] || need+=(nginx-light)
{ command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; } || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
command -v prometheus-pushgateway >/dev/null || need+=(prometheus-pushgateway)
for tool in podman runc debootstrap curl; do command -v $tool >/dev/null || need+=($tool); done
# and what podman was run with on the development machine (installed there beside it; rootless
# and overlay helpers that podman only recommends):
{ command -v newuidmap >/dev/null && command -v fuse-overlayfs >/dev/null && command -v slirp4netns >/dev/null; } || need+=(uidmap fuse-overlayfs slirp4netns)
if [ ${#need[@]} -gt 0 ]; then
  echo "test: apt-get install ${need[*]}"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# Here the tests that need these tools fail instead of skipping when one cannot run (tests/helpers/required.py).
export KF_REQUIRE_SLURM=1 KF_REQUIRE_BROWSER=1 KF_REQUIRE_NGINX=1 KF_REQUIRE_PODMAN=1 KF_REQUIRE_PUSHGATEWAY=1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # keep every Ray on 127.0.0.1 (../shared/notes/loopback.md)
# Two pytest processes (KF_TEST_WORKERS; 0: one), each test file whole in one of them: much of
# the suite waits on launches, rendezvous and timeouts, which the other process fills.
pytest=(.venv/bin/python -m pytest -q -n "${KF_TEST_WORKERS:-2}" --dist loadfile)
if [ $# -gt 0 ]; then exec "${pytest[@]}" "$@"; fi  # the tests named, whatever their stage
# Three stages: the suite (its goal: under 10 minutes on 2 cores), the tests marked `long` (what
# only a long run shows: chaos runs, replicas, the demo), then those marked `containers` (the CPU
# image built with podman and the pipeline run in it: the build about 2 min when pip's cache holds
# the host's wheels, 6 min cold on the development machine; one pytest process, the build uses
# both cores). pyproject.toml lists the markers.
# KF_TEST_STAGE=suite, long or containers runs one of them.
stage=${KF_TEST_STAGE:-all}
marked() {  # the stage's tests; 5 (none selected) is no failure
  local rc=0; "$@" || rc=$?
  [ $rc = 0 ] || [ $rc = 5 ] || exit $rc
}
if [ "$stage" = all ] || [ "$stage" = suite ]; then
  echo "test: the suite (not marked long or containers)"
  "${pytest[@]}" -m "not long and not containers" --durations 15  # (the slowest, for the 10-minute goal)
fi
if [ "$stage" = all ] || [ "$stage" = long ]; then
  echo "test: the long stage (marked long)"
  marked "${pytest[@]}" -m "long and not containers"
fi
if [ "$stage" = all ] || [ "$stage" = containers ]; then
  echo "test: the container stage (marked containers)"
  marked .venv/bin/python -m pytest -q -m containers tests/test_container_images.py
fi
