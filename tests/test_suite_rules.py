"""The suite's own rules.

* The leftover check (tests/conftest.py): a process a test starts and that outlives the session
  fails the run and is killed, even one that left the process tree with a scrubbed environment
  (``setsid env -i ... &``: a new session, no parent of its own, no trace of the suite in its
  environment). A pytest session of one such test runs here as the suite runs (two xdist workers),
  in a cgroup of its own, and as where no cgroup can be made (``KF_TEST_CGROUP=0``: the machine's
  processes before and after, by start time and parent chain), there in a PID namespace of its own
  under a shell, so that the escaped process is re-parented to the shell, out of the session's tree,
  and no other process of this machine is the inner session's to judge.
* Every system tool a test requires (tests/required.py: the browser, nginx, Slurm, podman) is required by
  the test command, scripts/test.sh, so that CI cannot pass with those tests skipped."""
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
def test_a_process_that_left_the_tree_with_a_scrubbed_environment_fails_the_session_and_is_killed(tmp_path, check):
    marker = f"{os.getpid()}{len(str(tmp_path))}.25"  # sleep's seconds, unique to this test
    for helper in ("conftest.py", "runbooks.py"):  # the suite's conftest, and what it imports
        shutil.copy(HERE / helper, tmp_path / helper)
    (tmp_path / "test_escape.py").write_text(ESCAPE.format(marker=marker))
    try:
        session = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)]
        if check == "snapshot":  # the shell is the namespace's init: orphans go to it, not to pytest
            session = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", '"$@"; exit $?', "sh", *session]
        p = subprocess.run(session, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "KF_LEFTOVER_GRACE_S": "1", "KF_TEST_CGROUP": "1" if check == "cgroup" else "0"})
        left = processes_with(marker)
        assert p.returncode == 1, p.stdout[-3000:]
        assert ("checked by start time and parent chain" in p.stdout) is (check == "snapshot"), p.stdout[-3000:]
        assert "1 processes started by the suite were still running (now killed)" in p.stdout, p.stdout[-3000:]
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
    assert named == {"browser", "nginx", "podman", "slurm"} and {n.upper() for n in named} <= exported, (named, exported)
