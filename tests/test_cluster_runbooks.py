"""The runbooks in docs/runbooks: every command is run by a test or the demo, or marked as needing
a real cluster, and the figures they quote are what the project's tools print.

Each ```bash block follows a marker line: "*Run by `FILE`.*" (the named test or script runs that
command: for a shell file an invocation of the same subcommand with at least the same flags, for
a Python test the program, subcommand and every flag as string literals) or "*Needs a real
cluster.*". Every ``ingest``/``shards``/``trainer``/``shard-service`` command in any code block
(bash, a systemd unit, a crontab) is parsed by the project's own argparse parsers, so a removed or
misspelt flag fails here, and every runbook is listed in the runbooks' README.
"""
from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from commandlines import logical_lines, parse, project_commands

from shards.partition import per_rank
from trainer.schedules.recipe import scaled_lr

ROOT = Path(__file__).resolve().parents[1]
RUNBOOKS = sorted((ROOT / "docs" / "runbooks").glob("*.md"))
MARKER = re.compile(r"^\*(?:Run by (?P<files>.+?)|(?P<cluster>Needs a real cluster))\.\*$")
LAUNCHERS = {"python", "python3", "bash", "sh", "exec", "env", "export"}


def blocks(path: Path) -> list[tuple[str, list[str], str]]:
    """(marker kind, files named, code) for every bash block of a runbook."""
    found, lines = [], path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "```bash":
            continue
        end = lines.index("```", i + 1)
        previous = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
        marker = MARKER.match(previous)
        assert marker, f"{path.name}:{i + 1}: a bash block without a 'Run by' or 'Needs a real cluster' line"
        files = re.findall(r"`([^`]+)`", marker["files"] or "")
        found.append(("cluster" if marker["cluster"] else "run", files, "\n".join(lines[i + 1:end])))
    return found


ALL = [(path.name, *block) for path in RUNBOOKS for block in blocks(path)]


def flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def python_literals(source: str) -> set[str]:
    """String constants of a Python file, split on whitespace (commands are often joined strings)."""
    words = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.add(node.value)
            words.update(node.value.split())
    return words


def runs_in(argv: list[str], path: Path) -> bool:
    """Whether ``path`` runs this project command: same subcommand, at least these flags."""
    text = path.read_text()
    if path.suffix == ".py":
        literals = python_literals(text)
        return all(word in literals for word in [*argv[:2], *flags(argv)])
    return any(other[:2] == argv[:2] and flags(argv) <= flags(other) for other in project_commands(text))


def program(line: str) -> str:
    """The program a shell line runs, past launchers and variable assignments."""
    for word in shlex.split(line):
        if word not in LAUNCHERS and not re.fullmatch(r"\w+=.*", word):
            return word
        if re.fullmatch(r"\w+=.*", word) and line.startswith("export"):
            return word.split("=", 1)[0]
    return ""


def test_every_block_is_marked_and_there_are_both_kinds():
    assert len(RUNBOOKS) >= 7 and "service.md" in {p.name for p in RUNBOOKS}
    kinds = {kind for _, kind, _, _ in ALL}
    assert kinds == {"run", "cluster"}


def test_every_runbook_is_listed_and_every_example_command_parses():
    listed = re.findall(r"\]\(([\w.-]+\.md)\)", (ROOT / "docs" / "runbooks" / "README.md").read_text())
    assert sorted(listed) == sorted(p.name for p in RUNBOOKS if p.name != "README.md")
    examples = 0
    for path in RUNBOOKS:
        fences = re.split(r"^```(\w*)\n", path.read_text(), flags=re.M)  # text, lang, code, "", text, ...
        for lang, code in zip(fences[1::2], fences[2::2]):
            if lang not in ("", "bash"):  # an opening fence (closing ones have no language)
                for argv in project_commands(code):
                    parse(argv)
                    examples += 1
    assert examples >= 3  # the service's systemd unit and crontab


@pytest.mark.parametrize("name,kind,files,code", ALL, ids=[f"{a[0]}-{i}" for i, a in enumerate(ALL)])
def test_runbook_block(name, kind, files, code):
    commands = project_commands(code)
    for argv in commands:
        parse(argv)  # every flag exists, whatever the block's kind
    if kind == "cluster":
        return
    paths = [ROOT / f for f in files]
    assert paths and all(p.is_file() for p in paths), files
    for argv in commands:
        assert any(runs_in(argv, p) for p in paths), f"{name}: {' '.join(argv[:2])} {sorted(flags(argv))} not run by {files}"
    for line in logical_lines(code):
        if not project_commands(line):
            word = program(line)
            assert any(word.rsplit("/", 1)[-1] in p.read_text() for p in paths), f"{name}: {word} not run by {files}"


def test_recipe_figures_are_what_the_code_derives():
    text = (ROOT / "docs" / "runbooks" / "recipe-1536-gpus.md").read_text()
    gpus, batch = 1536, 8
    assert f"{gpus * batch:,}" in text and f"**{scaled_lr(0.00125, gpus * batch):g}**" in text
    assert f"**{per_rank(240_000, gpus, batch) // batch} steps per epoch**" in text


def test_scaling_prediction_quoted_is_what_bench_scaling_prints(tmp_path):
    out = tmp_path / "scaling.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "scaling.py"), "--json", str(out)], check=True,
                   capture_output=True, timeout=60)
    row = next(r for r in json.loads(out.read_text())["rows"] if r["gpus"] == 1536)
    text = (ROOT / "docs" / "runbooks" / "recipe-1536-gpus.md").read_text()
    for variant in ("fp32 overlap", "fp16 overlap", "fp32"):
        figures = row[variant]
        assert f"{100 * figures['efficiency']:.0f}%" in text and f"{figures['clips_per_s']:,.0f}" in text, variant
        assert f"{figures['step_ms']:.1f} ms" in text, variant


def test_layout_figures_quoted_are_what_shards_plan_prints():
    plan = subprocess.run([sys.executable, "-m", "shards", "plan", "--clips", "240000", "--clip-size", "150kB",
                           "--max-world-size", "1536"], capture_output=True, text=True, timeout=120, check=True)
    row = next(line for line in plan.stdout.splitlines() if line.split()[:1] == ["1536"])
    recommended = re.search(r"Recommended: (\d+) shards of ~[\d,]+ clips \(~(\d+) MB\)", plan.stdout)
    opens, total, ratio = re.search(r"\|\s+([\d.]+) \(max.*?\)\s+([\d,]+) \|.*\|\s+([\d,]+x)$", row).groups()
    text = (ROOT / "docs" / "runbooks" / "parallel-filesystems.md").read_text()
    assert f"{recommended[1]} shards of ~{recommended[2]} MB" in text
    assert f"{opens} opens per rank" in text and f"({total} in all)" in text and ratio in text
