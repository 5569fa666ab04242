"""Test helper: the command blocks of the runbooks (docs/runbooks/*.md and docs/service.md), run as written.

Every ```bash block is a list of commands (a logical line each: continuations joined, comments
dropped). A command that cannot run on one machine carries ``# needs: WHAT`` (more nodes, GPUs,
a Lustre filesystem, a container engine), as a trailing comment or, for the whole block, as the
block's first line. Every other command runs in the suite: the block is preceded by
"*Run by `TEST`.*", and that test calls ``run_block(RUNBOOK, FIRST, ...)`` or
``block_commands(RUNBOOK, FIRST, ...)`` with the runbook's file name and the start of the block's
first command. Both read the block from the runbook when the test runs, so what runs is the text
a reader pastes; the only changes are the caller's substitution table (a cluster's data paths,
host names and ports -> the test's small local stand-ins), which the caller writes out in full.
tests/test_cluster_runbooks.py checks that every command is run so or marked.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNBOOKS = sorted((ROOT / "docs" / "runbooks").glob("*.md")) + [ROOT / "docs" / "service.md"]
NEEDS = re.compile(r"#\s*needs:\s*(.+)$")
RUN_BY = re.compile(r"^\*Run by (.+)\.\*$")


@dataclass
class Command:
    text: str  # the logical line, trailing comment dropped
    needs: str | None  # why it cannot run here; None: it runs in the suite


@dataclass
class Block:
    runbook: str  # its path from docs/runbooks: "training.md", "../service.md"
    line: int  # the opening fence's line number
    run_by: list[str]  # the test files the "*Run by*" line names
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
        end = lines.index("```", i + 1)
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
        found.append(Block(name(path), i + 1, re.findall(r"`([^`]+)`", run_by[1]) if run_by else [], commands))
    return found


def name(path: Path) -> str:
    """How callers name a runbook: its path from docs/runbooks ("training.md", "../service.md")."""
    return os.path.relpath(path, ROOT / "docs" / "runbooks")


def find(runbook: str, first: str) -> Block:
    path = next(p for p in RUNBOOKS if name(p) == runbook)
    blocks = [b for b in parse(path) if b.starts_with(first)]
    assert len(blocks) == 1, f"{runbook}: {len(blocks)} bash blocks start with {first!r}"
    return blocks[0]


def block_commands(runbook: str, first: str, subs: dict[str, str] | None = None) -> list[str]:
    """The commands of the block of ``runbook`` starting with ``first`` that run on one machine,
    with ``subs`` applied (each key replaced by its value, in order)."""
    out = []
    for command in find(runbook, first).commands:
        if command.needs is None:
            text = command.text
            for old, new in (subs or {}).items():
                text = text.replace(old, new)
            out.append(text)
    return out


def shell_env(env: dict | None = None) -> dict:
    """The environment a reader has after ``source .venv/bin/activate``: the project's commands and
    its Python first on the PATH."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_block(runbook: str, first: str, subs: dict[str, str] | None = None, *, cwd, env: dict | None = None,
              activated: bool = True, timeout: float = 300) -> str:
    """Run the block's commands (``block_commands``) with bash in ``cwd``; returns stdout and stderr
    together. ``activated``: with the project's environment on the PATH (``shell_env``)."""
    return run_commands(block_commands(runbook, first, subs), cwd=cwd, env=shell_env(env) if activated else env,
                        timeout=timeout)


def run_commands(commands: list[str], *, cwd, env: dict | None = None, timeout: float = 300) -> str:
    """Run shell commands with bash in ``cwd``, stopping at the first that fails (an AssertionError
    with the script and the output's tail); returns stdout and stderr together."""
    script = "\n".join(["set -euo pipefail", *commands])
    proc = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, f"failed ({proc.returncode}):\n{script}\n--- output:\n{proc.stdout[-4000:]}"
    return proc.stdout
