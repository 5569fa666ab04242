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
# (tests/postgres.py starts its own with initdb/pg_ctl in a temporary directory, never the system's).
need=()
{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || need+=(chromium chromium-driver)
[ -x /usr/sbin/nginx ] || need+=(nginx-light)
{ command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; } || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
if [ ${#need[@]} -gt 0 ]; then
  echo "test: apt-get install ${need[*]}"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
export KF_REQUIRE_SLURM=1  # here the Slurm test fails instead of skipping when Slurm cannot run
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # keep every Ray on 127.0.0.1 (../shared/notes/loopback.md)
# Two pytest processes (KF_TEST_WORKERS; 0: one), each test file whole in one of them: much of
# the suite waits on launches, rendezvous and timeouts, which the other process fills.
pytest=(.venv/bin/python -m pytest -q -n "${KF_TEST_WORKERS:-2}" --dist loadfile)
if [ $# -gt 0 ]; then exec "${pytest[@]}" "$@"; fi  # the tests named, whatever their stage
# Two stages: the suite (its goal: under 10 minutes on 2 cores), then the tests marked `long`
# (what only a long run shows: chaos runs, images built; pyproject.toml lists the marker).
# KF_TEST_STAGE=suite or long runs one of them.
stage=${KF_TEST_STAGE:-all}
if [ "$stage" != long ]; then
  echo "test: the suite (not marked long)"
  "${pytest[@]}" -m "not long"
fi
if [ "$stage" != suite ]; then
  echo "test: the long stage (marked long)"
  rc=0; "${pytest[@]}" -m long || rc=$?
  [ $rc = 0 ] || [ $rc = 5 ] || exit $rc  # 5: no test is marked long
fi
