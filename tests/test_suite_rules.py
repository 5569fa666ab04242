"""The suite's own rules.

* The leftover check (tests/conftest.py): a process a test starts and that outlives the session
  fails the run and is killed, even one that left the process tree with a scrubbed environment
  (``setsid env -i ... &``: a new session, no parent of its own, no trace of the suite in its
  environment). A pytest session of one such test runs here as the suite runs (two xdist workers),
  in a cgroup of its own, and as where no cgroup can be made (``KF_TEST_CGROUP=0``: the machine's
  processes before and after, by start time and parent chain), there in a PID namespace of its own
  under a shell, so that the escaped process is re-parented to the shell, out of the session's tree,
  and no other process of this machine is the inner session's to judge.
* The runbook check (tests/conftest.py, tests/helpers/runbooks.py) holds a stage to the blocks of the tests
  it ran: a block whose "*Run by*" line names a test marked ``long`` is not required of the suite's
  stage (``-m "not long"``), nor the others of the long stage; one naming only the file is.
* Every system tool a test requires (tests/helpers/required.py: the browser, nginx, Slurm, podman) is required
  by the test command, scripts/test.sh, so that CI cannot pass with those tests skipped."""
from __future__ import annotations

import ast
import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent
# the suite's conftest, and what it imports
HELPERS = ("conftest.py", "helpers/__init__.py", "helpers/runbooks.py")
ESCAPE = """
import subprocess


def test_starts_a_process_that_escapes():
    subprocess.run(["bash", "-c", "setsid env -i sleep {marker} </dev/null >/dev/null 2>&1 &"], check=True)
"""


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if marker in (p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


@pytest.mark.parametrize("check", ["cgroup", "snapshot"])
def test_a_process_that_left_the_tree_with_a_scrubbed_environment_fails_the_session_and_is_killed(
        tmp_path, check):
    marker = f"{os.getpid()}{len(str(tmp_path))}.25"  # sleep's seconds, unique to this test
    for helper in HELPERS:
        (tmp_path / helper).parent.mkdir(exist_ok=True)
        shutil.copy(HERE / helper, tmp_path / helper)
    (tmp_path / "test_escape.py").write_text(ESCAPE.format(marker=marker))
    try:
        session = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)]
        if check == "snapshot":  # the shell is the namespace's init: orphans go to it, not to pytest
            session = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", '"$@"; exit $?', "sh",
                       *session]
        p = subprocess.run(session, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "KF_LEFTOVER_GRACE_S": "1", "KF_TEST_CGROUP": "1"
                                if check == "cgroup" else "0"})
        left = processes_with(marker)
        assert p.returncode == 1, p.stdout[-3000:]
        chained = "checked by start time and parent chain" in p.stdout
        assert chained is (check == "snapshot"), p.stdout[-3000:]
        killed = "1 processes started by the suite were still running (now killed)"
        assert killed in p.stdout, p.stdout[-3000:]
        assert f"sleep {marker}" in p.stdout and "1 passed" in p.stdout, p.stdout[-3000:]
        assert not left, left
    finally:
        for proc in processes_with(marker):  # only what this test started: its marker
            proc.kill()


def test_the_test_command_requires_every_tool_a_test_requires():
    named = set()
    for path in HERE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require":
                named.add(node.args[0].value)
    script = (HERE.parent / "scripts" / "test.sh").read_text()
    exported = set(re.findall(r"\bKF_REQUIRE_(\w+)=1", "\n".join(re.findall(r"^export .*$", script, re.M))))
    assert named == {"browser", "nginx", "podman", "pushgateway", "slurm"}, named
    assert {n.upper() for n in named} <= exported, (named, exported)


PAGE = """# Page

*Run by `tests/test_pages.py{quick}`.*

```bash
echo quick-{marker}
```

*Run by `tests/test_pages.py{slow}`.*

```bash
echo slow-{marker}
```
{never}"""
NEVER = """
*Run by `tests/test_pages.py::test_slow`.*

```bash
echo never
```
"""
PAGE_TESTS = """import pytest
from helpers.runbooks import run_block


def test_quick(tmp_path):
    run_block("page.md", "echo quick", cwd=tmp_path)


@pytest.mark.long
def test_slow(tmp_path):
    run_block("page.md", "echo slow", cwd=tmp_path)
"""


@pytest.mark.parametrize("named, never, stage, unrun", [
    (True, False, "not long", None),  # the suite's stage: the long test's block is not held against it
    (True, False, "long", None),  # the long stage: nor the quick test's
    (True, True, "long", "echo never"),  # a block of a test that ran is held, every command of it
    (False, False, "not long", "echo slow"),  # blocks naming only the file: the deselected test's fails
])
def test_the_runbook_check_holds_a_stage_to_the_blocks_of_the_tests_it_ran(tmp_path, named, never, stage,
                                                                            unrun):
    """tests/conftest.py's ledger check in a session of its own (the suite's conftest and runbooks
    copied beside a page of two blocks, one run by a test marked long), selected by stage (``-m``)."""
    marker = f"{os.getpid()}"
    (tmp_path / "tests").mkdir()
    (tmp_path / "docs" / "runbooks").mkdir(parents=True)
    for helper in HELPERS:
        (tmp_path / "tests" / helper).parent.mkdir(exist_ok=True)
        shutil.copy(HERE / helper, tmp_path / "tests" / helper)
    (tmp_path / "tests" / "test_pages.py").write_text(PAGE_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    long: slow\n")
    (tmp_path / "docs" / "runbooks" / "page.md").write_text(PAGE.format(
        quick="::test_quick" if named else "", slow="::test_slow" if named else "", marker=marker,
        never=NEVER if never else ""))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", stage, "tests"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KF_LEFTOVER_GRACE_S": "1", "PYTHONPATH": str(tmp_path / "tests")})
    assert "1 passed, 1 deselected" in p.stdout, p.stdout[-3000:]
    if unrun is None:
        assert p.returncode == 0 and "runbook commands were not run" not in p.stdout, p.stdout[-3000:]
    else:
        assert p.returncode == 1, p.stdout[-3000:]
        assert "1 runbook commands were not run by the tests that run their blocks" in p.stdout, \
            p.stdout[-3000:]
        assert unrun in p.stdout, p.stdout[-3000:]
