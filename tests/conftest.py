"""Session-wide fixtures and checks.

* ``ray_local``: one local Ray on loopback for the whole run (it costs seconds to start); always a
  new one (address="local"), never another Ray running on the machine.
* ``postgres``: one PostgreSQL server on loopback for the run (``tests/postgres.py``), stopped at
  its end; ``catalog_location``: a new catalog on each back end in turn, a SQLite file and a
  database of that server (the catalog tests run on both).
* Nothing the suite starts may outlive it. The session (the controller, under pytest-xdist) puts a
  token of its own in ``KF_TEST_SESSION``, which every process it starts inherits: pytest's
  workers, servers, Ray's daemons and workers, horovodrun and its ranks, Slurm's daemons and jobs.
  Once the session is over (the workers gone, every fixture torn down), any process still carrying
  the token, or still a descendant of the session, is listed, killed, and fails the run. Processes
  that are merely slow to go (Ray's, which ``ray.shutdown()`` reaps asynchronously) get
  ``LEFTOVER_GRACE_S`` to exit first.
"""
from __future__ import annotations

import os
import uuid

import psutil
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray 2.60 turns on token authentication for a new local cluster by default, and processes that
# join one (`ingest build --address`) disagree about it when they read the token differently;
# every Ray of the tests lives on 127.0.0.1 and is reached by the tests alone.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

SESSION_VAR = "KF_TEST_SESSION"
LEFTOVER_GRACE_S = 30


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=150 * 2**20,
             logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def postgres():
    from postgres import PostgresServer

    server = PostgresServer()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_location(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "catalog.sqlite")
    return request.getfixturevalue("postgres").database()


def controller(config) -> bool:
    """Whether this process runs the session (not a pytest-xdist worker)."""
    return not hasattr(config, "workerinput")


def pytest_configure(config):
    if controller(config):  # before xdist starts its workers, which inherit it
        os.environ[SESSION_VAR] = uuid.uuid4().hex


def suite_processes() -> list[psutil.Process]:
    """Processes carrying this session's token or descending from this process; not this process
    nor its ancestors (the shell, a CI runner), nor this process's own multiprocessing resource
    tracker (started by a test's spawn context, it ends with this process) and fork server (started
    by a build without Ray in a process that runs threads, ``ingest.local_runtime``; it ends with
    this process too)."""
    from multiprocessing import forkserver, resource_tracker

    me = psutil.Process()
    exempt = {me.pid, *(p.pid for p in me.parents()), getattr(resource_tracker._resource_tracker, "_pid", None),
              getattr(forkserver._forkserver, "_forkserver_pid", None)}
    found = {p.pid: p for p in me.children(recursive=True)}
    token = os.environ[SESSION_VAR]
    for p in psutil.process_iter():
        try:
            if p.pid not in found and p.environ().get(SESSION_VAR) == token:
                found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for pid, p in found.items() if pid not in exempt and running(p)]


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:300] or p.name()}"
    except psutil.Error:
        return f"pid {p.pid}: (gone)"


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session):
    result = yield  # after every other plugin's finish: xdist has shut its workers down by then
    if controller(session.config) and SESSION_VAR in os.environ:
        check_leftovers(session)
    return result


def check_leftovers(session) -> None:
    _, alive = psutil.wait_procs(suite_processes(), timeout=LEFTOVER_GRACE_S)
    alive = [p for p in alive if running(p)]
    if not alive:
        return
    lines = [describe(p) for p in alive]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_sep("=", f"{len(alive)} processes started by the suite were still running (now killed)",
                           red=True)
        for line in lines:
            reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
