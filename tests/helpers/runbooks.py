"""Test helper: the command blocks of the runbooks (docs/runbooks/*.md and docs/service.md), run as written,
and by the same rule those of README.md and the rest of docs/ (``PAGES``).

Every ```bash block is a list of commands (a logical line each: continuations joined, comments
dropped). A command that cannot run on one machine carries ``# needs: WHAT`` (more nodes, GPUs,
a Lustre filesystem, a container engine), as a trailing comment or, for the whole block, as the
block's first line. Every other command runs in the suite: the block is preceded by
"*Run by `TEST`.*" (a test file, or ``FILE::NAME``: one test of it), and that test calls ``run_block(RUNBOOK,
FIRST, ...)`` or ``block_commands(RUNBOOK, FIRST, ...)`` with the runbook's file name and the start of the
block's first command. Both read the block from the runbook when the test runs, so what runs is the text
a reader pastes; the only changes are the caller's substitution table (a cluster's data paths,
host names and ports -> the test's small local stand-ins), which the caller writes out in full. A
substitution may change a command's arguments, never the command itself (its first word): a table
cannot turn a line into another command or into nothing (``"ray stop": "true"``).

What ran is recorded: ``run_commands`` appends each command's key (``RUNBOOK:LINE:INDEX``) to the
session's ledger (``$KF_RUNBOOK_LEDGER``, made by tests/conftest.py) once the command has exited
0, and fails unless every command of its script did; a test that runs a command itself (a server
started from the block's line) records it with ``ran``. tests/test_cluster_runbooks.py checks
that every command is run so or marked; at the end of a session that ran the suite,
tests/conftest.py checks the ledger (``unexecuted``): every command not marked was executed, of
the blocks whose runner ran and passed: the file a "*Run by*" line names (every test of it that
ran passed), or the one test it names. A file whose tests run in different stages (one marked
``long``: deselected by the suite's ``-m``, while the long stage deselects the rest) names each
block's test, so that each stage is held to the blocks of the tests it ran.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = [p for p in sorted((ROOT / "docs" / "runbooks").glob("*.md")) + [ROOT / "docs" / "service.md"]
            # (none where this module is copied out of the checkout: tests/test_suite_rules.py)
            if p.exists()]
# The same rule for every other page: README.md and the rest of docs/ (tests/test_docs.py runs their blocks)
PAGES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
         if p.exists() and p not in RUNBOOKS and "runbooks" not in p.parts]
RUNBOOKS += PAGES
NEEDS = re.compile(r"#\s*needs:\s*(.+)$")
RUN_BY = re.compile(r"^\*Run by (.+)\.\*$")
LEDGER_VAR = "KF_RUNBOOK_LEDGER"


@dataclass
class Command:
    text: str  # the logical line, trailing comment dropped
    needs: str | None  # why it cannot run here; None: it runs in the suite


@dataclass
class Block:
    runbook: str  # its path from docs/runbooks: "training.md", "../service.md"
    line: int  # the opening fence's line number
    run_by: list[str]  # the test files (or FILE::TEST, one test) the "*Run by*" line names
    commands: list[Command]

    def starts_with(self, first: str) -> bool:
        return bool(self.commands) and self.commands[0].text.startswith(first)


def logical_lines(code: str) -> list[str]:
    """Shell lines with backslash continuations joined (comment lines kept: they carry markers)."""
    return [line.strip() for line in re.sub(r"\\\n\s*", " ", code).splitlines() if line.strip()]


def parse(path: Path) -> list[Block]:
    """Every bash block of a runbook, with its commands and markers."""
    lines, found = path.read_text().splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != "```bash":
            continue
        # (a list item's: indented)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        previous = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
        run_by = RUN_BY.match(previous)
        block_needs, commands = None, []
        for text in logical_lines("\n".join(lines[i + 1:end])):
            needs = NEEDS.search(text)
            if text.startswith("#"):
                if needs and not commands:
                    block_needs = needs[1].strip()
                continue
            command = re.sub(r"\s+#.*$", "", text) if needs or " #" in text else text
            commands.append(Command(command.strip(), needs[1].strip() if needs else block_needs))
        found.append(Block(name(path), i + 1, re.findall(r"`([^`]+)`", run_by[1]) if run_by else [],
                           commands))
    return found


def name(path: Path) -> str:
    """How callers name a runbook: its path from docs/runbooks ("training.md", "../service.md")."""
    return os.path.relpath(path, ROOT / "docs" / "runbooks")


def find(runbook: str, first: str) -> Block:
    path = next(p for p in RUNBOOKS if name(p) == runbook)
    blocks = [b for b in parse(path) if b.starts_with(first)]
    assert len(blocks) == 1, f"{runbook}: {len(blocks)} bash blocks start with {first!r}"
    return blocks[0]


class RunbookCommand(str):
    """A runbook command as it runs (substitutions applied); ``key`` names it in the ledger."""
    key: str

    def __new__(cls, text: str, key: str):
        self = super().__new__(cls, text)
        self.key = key
        return self


def key(block: Block, index: int) -> str:
    return f"{block.runbook}:{block.line}:{index}"


def block_commands(runbook: str, first: str, subs: dict[str, str] | None = None) -> list[RunbookCommand]:
    """The commands of the block of ``runbook`` starting with ``first`` that run on one machine,
    with ``subs`` applied (each key replaced by its value, in order). A substitution that changes
    a command's first word (the command itself) is refused."""
    block, out = find(runbook, first), []
    for index, command in enumerate(block.commands):
        if command.needs is None:
            text = command.text
            for old, new in (subs or {}).items():
                text = text.replace(old, new)
            if shlex.split(text)[:1] != shlex.split(command.text)[:1]:
                raise AssertionError(f"{runbook}:{block.line}: a substitution makes {command.text!r} another "
                                     f"command ({text!r}); substitute its arguments only")
            out.append(RunbookCommand(text, key(block, index)))
    return out


def record(keys: list[str]) -> None:
    """Note in the session's ledger that the commands ``keys`` name ran (and by which test)."""
    ledger = os.environ.get(LEDGER_VAR)
    if ledger and keys:
        test = os.environ.get("PYTEST_CURRENT_TEST", "")
        with open(ledger, "a") as f:
            f.write("".join(f"{k}\t{test}\n" for k in keys))


def ran(command: RunbookCommand) -> None:
    """Record a command the test ran itself (not through ``run_commands``), once it saw it work."""
    record([command.key])


def runner(run_by: str) -> Path | None:
    """The test file a "*Run by*" entry (``FILE`` or ``FILE::TEST``) names, where it exists (and
    holds that test); else None."""
    file, _, test = run_by.partition("::")
    path = ROOT / file
    if not (path.is_file() and path.suffix == ".py"):
        return None
    if test and not re.search(rf"^def {re.escape(test)}\(", path.read_text(), re.M):
        return None
    return path


def unexecuted(ledger: str, run_by: set[str]) -> list[str]:
    """The commands not marked ``# needs:`` of the blocks run by ``run_by`` (test files, and
    ``FILE::TEST`` names of single tests) that the ledger does not record as run: one line each,
    naming the runbook, the block and the command."""
    done = set()
    if os.path.exists(ledger):
        with open(ledger) as f:
            done = {line.split("\t")[0] for line in f}
    return [f"{b.runbook}:{b.line}: {c.text[:80]!r}" for path in RUNBOOKS for b in parse(path)
            if run_by & set(b.run_by) for i, c in enumerate(b.commands) if c.needs is None
            and key(b, i) not in done]


def shell_env(env: dict | None = None) -> dict:
    """The environment a reader has after ``source .venv/bin/activate``: the project's commands and
    its Python first on the PATH."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_block(runbook: str, first: str, subs: dict[str, str] | None = None, *, cwd, env: dict | None = None,
              activated: bool = True, timeout: float = 300, own_processes: bool = False) -> str:
    """Run the block's commands (``block_commands``) with bash in ``cwd``; returns stdout and stderr
    together. ``activated``: with the project's environment on the PATH (``shell_env``);
    ``own_processes``: see ``run_commands``."""
    return run_commands(block_commands(runbook, first, subs),
                        cwd=cwd, env=shell_env(env) if activated else env,
                        timeout=timeout, own_processes=own_processes)


def run_commands(commands: list[str], *, cwd, env: dict | None = None, timeout: float = 300,
                 own_processes: bool = False) -> str:
    """Run shell commands with bash in ``cwd``, stopping at the first that fails (an AssertionError
    with the script and the output's tail); returns stdout and stderr together. Every command must
    have run and exited 0 (one that ends the script early, such as ``exec`` or ``exit``, fails it);
    a runbook's are recorded in the ledger. ``own_processes``: in a PID namespace of its own
    (``unshare``, as root), where a command that acts on every process of the machine of some
    kind (``ray stop``) sees those the script started alone, and which the kernel empties when
    the script ends."""
    with tempfile.NamedTemporaryFile("r", prefix="kf-ran-", suffix=".txt") as ran_file:
        lines = ["set -euo pipefail"]
        for n, command in enumerate(commands):
            lines += [command, f"echo {n} >> {shlex.quote(ran_file.name)}"]
        script = "\n".join(lines)
        argv = ["bash", "-c", script]
        if own_processes:
            argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
        proc = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
        done = [int(n) for n in ran_file.read().split()]
    shown = "\n".join(commands)
    assert proc.returncode == 0, f"failed ({proc.returncode}):\n{shown}\n--- output:\n{proc.stdout[-4000:]}"
    assert done == list(range(len(commands))), f"ran {len(done)} of {len(commands)} commands:\n{shown}"
    record([c.key for c in commands if isinstance(c, RunbookCommand)])
    return proc.stdout
