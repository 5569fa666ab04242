"""Session-wide fixtures and checks.

* ``ray_local``: one local Ray on loopback for the whole run (it costs seconds to start); always a
  new one (address="local"), never another Ray running on the machine.
* ``postgres``: one PostgreSQL server on loopback for the run (``tests/helpers/postgres.py``), stopped at
  its end; ``catalog_location``: a new catalog on each back end in turn, a SQLite file and a
  database of that server (the catalog tests run on both).
* Nothing the suite starts may outlive it. The session (the controller, under pytest-xdist) moves
  itself into a cgroup of its own (``SessionGroup``, cgroup v2), which every process it starts
  and their descendants are born into, whatever they do to their parent, session, group or
  environment (a daemon's double fork, ``setsid env -i ... &``): the kernel keeps the lineage that
  a parent chain loses when a parent exits. Once the session is over (the workers gone, every
  fixture torn down), every process in that cgroup (and its sub-cgroups) but the session itself,
  every descendant of the session, and every process carrying the session's token (in
  ``KF_TEST_SESSION``, inherited by what keeps its environment) is listed, killed, and fails the
  run. Processes that are merely slow to go (Ray's, which ``ray.shutdown()`` reaps asynchronously)
  get ``LEFTOVER_GRACE_S`` to exit first. Where no cgroup can be made (not root, no cgroup2
  mount, or ``KF_TEST_CGROUP=0``), the session says so and compares the machine's processes at
  its end with those at its start (``ProcessSnapshot``): a process of this user started since
  (one not in the snapshot, by pid and start time) is the session's when its parent chain reaches
  the session or one of its ancestors (an orphan is re-parented to init or a subreaper above it)
  before any process that predates the session (another session's shell or suite, a daemon).
* Every runbook command runs (tests/helpers/runbooks.py): the tests record the commands they ran in a
  ledger of the session's (``KF_RUNBOOK_LEDGER``); once a session that selected whole test files
  is over, every command not marked ``# needs:`` of a block whose test file ran (and passed, none
  of its tests skipped) must be in it, else the run fails naming the commands. A block whose
  "*Run by*" line names one test (``FILE::TEST``) counts when that test ran and passed: a stage
  that deselects a file's long test (``-m "not long"``) is not held to that test's blocks, nor
  the long stage to the blocks of the tests it deselects.
"""
from __future__ import annotations

import os
import signal
import tempfile
import time
import uuid
import warnings
from collections import defaultdict

import psutil
import pytest
from helpers import runbooks

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray 2.60 turns on token authentication for a new local cluster by default, and processes that
# join one (`ingest build --address`) disagree about it when they read the token differently;
# every Ray of the tests lives on 127.0.0.1 and is reached by the tests alone.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

SESSION_VAR = "KF_TEST_SESSION"
# tests/test_suite_rules.py's sessions: less
LEFTOVER_GRACE_S = float(os.environ.get("KF_LEFTOVER_GRACE_S", 30))
# the session's cgroup, or the processes before it
GROUP = pytest.StashKey["SessionGroup | ProcessSnapshot"]()
OUTCOMES: dict[str, set[str]] = defaultdict(set)  # test file, and FILE::TEST -> outcomes in this session


@pytest.fixture(autouse=True)
def stop_signals_left_as_found(request):
    """A test (or what it ran in this process: Ray, a loader, a trainer) that leaves SIGINT or SIGTERM
    ignored or handled its own way would hand that to every command the later tests of this
    process start (an ignored signal survives exec: Ctrl-C would not reach them). Put back, with
    a warning naming the test and the signal (in the run's warnings summary)."""
    found = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    changed = {s.name: h for s, h in ((s, signal.getsignal(s)) for s in found) if h is not found[s]}
    for s, h in found.items():
        signal.signal(s, h)
    if changed:
        warnings.warn(f"{request.node.nodeid} left {changed} (found {found}); put back", stacklevel=1)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    term = signal.getsignal(signal.SIGTERM)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=150 * 2**20,
             logging_level="WARNING")
    signal.signal(signal.SIGTERM, term)  # ray.init's handler (sys.exit) is not the tests' to keep
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def postgres():
    from helpers.postgres import PostgresServer

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
    if controller(config):  # before xdist starts its workers, which inherit them
        os.environ[SESSION_VAR] = uuid.uuid4().hex
        try:
            if os.environ.get("KF_TEST_CGROUP") == "0":
                raise OSError("KF_TEST_CGROUP=0")
            config.stash[GROUP] = SessionGroup(f"kf-test-{os.environ[SESSION_VAR]}")
        except OSError as e:
            config.stash[GROUP] = ProcessSnapshot(f"no cgroup for the session ({e})")
        fd, os.environ[runbooks.LEDGER_VAR] = tempfile.mkstemp(prefix="kf-runbook-ledger-", suffix=".txt")
        os.close(fd)


def pytest_runtest_logreport(report):
    """Each test's outcome, by file and by test (its parameters dropped), in the session's process
    (xdist's workers report there too)."""
    if report.when == "call" or report.outcome != "passed":
        OUTCOMES[report.nodeid.split("::")[0]].add(report.outcome)
        OUTCOMES[report.nodeid.split("[")[0]].add(report.outcome)


class SessionGroup:
    """A cgroup (v2) that this process moves into: every process started from then on, by it or
    by its descendants, is born into it (or a cgroup under it) and stays there, orphaned or not."""

    def __init__(self, name: str):
        mount = next((line.split(" - ")[0].split()[4] for line in open("/proc/self/mountinfo")
                      if line.split(" - ")[1].startswith("cgroup2 ")), None)
        if mount is None:
            raise OSError("no cgroup2 filesystem mounted")
        here = next(line.split("::", 1)[1].strip() for line in open("/proc/self/cgroup")
                    if line.startswith("0::"))
        self.parent = os.path.join(mount, here.lstrip("/"))
        self.path = os.path.join(self.parent, name)
        os.mkdir(self.path)
        try:
            self._enter(self.path)
        except OSError:
            os.rmdir(self.path)
            raise

    @staticmethod
    def _enter(path: str) -> None:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def members(self) -> set[int]:
        """Every process in the cgroup and the cgroups under it (a nested session's)."""
        found = set()
        for directory, _, _ in os.walk(self.path):
            with open(os.path.join(directory, "cgroup.procs")) as f:
                found.update(int(pid) for pid in f.read().split())
        return found

    def close(self) -> None:
        """Leave the cgroup and remove it (once its last member has been reaped)."""
        self._enter(self.parent)
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:  # still populated: a killed member not yet reaped
                time.sleep(0.1)


class ProcessSnapshot:
    """The machine's processes when the session began (where it has no cgroup): ``members`` are
    the processes of this user started since whose parent chain reaches the session's own chain
    (this process or an ancestor) before a process that predates the session."""

    def __init__(self, reason: str):
        self.reason = reason
        self.before = {(p.pid, p.info["create_time"]) for p in psutil.process_iter(["create_time"])}

    def predates(self, p: psutil.Process) -> bool:
        return (p.pid, p.create_time()) in self.before

    def members(self) -> set[int]:
        me = psutil.Process()
        session = {me.pid, *(p.pid for p in me.parents())}
        found = set()
        for p in psutil.process_iter():
            try:
                if p.uids().real != os.getuid() or self.predates(p):
                    continue
                parent = p.parent()
                while parent is not None and parent.pid not in session and not self.predates(parent):
                    parent = parent.parent()
            except psutil.Error:
                continue
            if parent is not None and parent.pid in session:
                found.add(p.pid)
        return found


def suite_processes(group: SessionGroup | ProcessSnapshot) -> list[psutil.Process]:
    """Processes in the session's cgroup (or started since it began and reaching it by their
    parent chain), descending from this process or carrying this session's token; not this
    process nor its ancestors (the shell, a CI runner), nor this process's own multiprocessing
    resource tracker (started by a test's spawn context, it ends with this process) and fork server
    (started by a build without Ray in a process that runs threads, ``ingest.tasks.local_runtime``; it
    ends with this process too)."""
    from multiprocessing import forkserver, resource_tracker

    me = psutil.Process()
    exempt = {me.pid, *(p.pid for p in me.parents()), getattr(resource_tracker._resource_tracker, "_pid",
                                                              None),
              getattr(forkserver._forkserver, "_forkserver_pid", None)}
    found = {p.pid: p for p in me.children(recursive=True)}
    for pid in group.members():
        try:
            found.setdefault(pid, psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
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
    """The process's command line, and the test that started it where its environment says so."""
    try:
        line = f"pid {p.pid}: {' '.join(p.cmdline()).strip()[:300] or p.name()}"
    except psutil.Error:
        return f"pid {p.pid}: (gone)"
    try:
        test = p.environ().get("PYTEST_CURRENT_TEST")
    except psutil.Error:
        test = None
    return line + (f" (started during {test})" if test else "")


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session):
    result = yield  # after every other plugin's finish: xdist has shut its workers down by then
    if controller(session.config) and GROUP in session.config.stash:
        group = session.config.stash[GROUP]
        try:
            check_runbooks(session)
            check_leftovers(session, group)
        finally:
            if isinstance(group, SessionGroup):
                group.close()
            os.remove(os.environ[runbooks.LEDGER_VAR])
    return result


def check_runbooks(session) -> None:
    """Every runbook command of the blocks whose runners ran and passed was executed: a test file
    (all its tests that ran passed), or a single test ``FILE::TEST`` that a block names."""
    config = session.config
    if config.option.keyword or any("::" in arg for arg in config.args):
        return  # some tests of a file alone: its blocks may belong to others
    passed = {f for f, outcomes in OUTCOMES.items() if outcomes == {"passed"}}
    missing = runbooks.unexecuted(os.environ[runbooks.LEDGER_VAR], passed)
    if missing:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("=", f"{len(missing)} runbook commands were not run by the tests that run "
                                    "their blocks", red=True)
            for line in missing:
                reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def check_leftovers(session, group: SessionGroup | ProcessSnapshot) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if isinstance(group, ProcessSnapshot) and reporter is not None:
        reporter.write_line(f"leftover processes: checked by start time and parent chain: {group.reason}")
    _, alive = psutil.wait_procs(suite_processes(group), timeout=LEFTOVER_GRACE_S)
    alive = [p for p in alive if running(p)]
    if not alive:
        return
    lines = [describe(p) for p in alive]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    if reporter is not None:
        reporter.write_line("")
        reporter.write_sep("=",
                           f"{len(alive)} processes started by the suite were still running (now killed)",
                           red=True)
        for line in lines:
            reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
