"""The runbooks (docs/runbooks/*.md, docs/service.md) run as written, and the figures they quote are
what the project's tools print.

Every command of a ```bash block either runs in the suite, the block's own text read from the
runbook and executed (``tests/helpers/runbooks.py``: on small data, on loopback, through a substitution
table written out in the test that runs it), or is marked ``# needs: WHAT`` in the runbook; the
first test counts both kinds and fails on a command that is neither. The blocks that need no
cluster, no servers and no launcher run here, on a small shard set and two short training runs
standing in for the demo's; the others run in the test the block's "*Run by*" line names. A
substitution may not replace a command, a script must run every command, and at the end of the
session tests/conftest.py checks the ledger of the commands that ran: each command of a block
whose test file ran was executed, not merely called somewhere in that file. Every
``ingest``/``shards``/``trainer``/``shard-service`` command in any code block (bash, a systemd
unit, a crontab), marked or not, is parsed by the project's own argparse parsers, so a removed or
misspelt flag fails here; and every runbook is listed in the runbooks' README.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.commandlines import parse, project_commands
from helpers.media import make_video
from helpers.runbooks import (
    LEDGER_VAR,
    RUNBOOKS,
    RunbookCommand,
    block_commands,
    run_block,
    run_commands,
    runner,
    unexecuted,
)
from helpers.runbooks import parse as parse_blocks
from helpers.shardsets import make_shardset

from shards.plan.partition import per_rank
from trainer.schedules.recipe import scaled_lr

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = [b for path in RUNBOOKS for b in parse_blocks(path)]
RUNNERS = ("run_block", "block_commands")
# the small stand-ins: the cluster paths of parallel-filesystems.md -> the demo's set made here
SHARDS = {"/lustre/shards/k400": "demo/shards"}


def runs(test: Path) -> set[tuple[str, str]]:
    """(runbook, start of the first command) of every block ``test`` runs with tests/helpers/runbooks.py."""
    found = set()
    for node in ast.walk(ast.parse(test.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id",
                                                  getattr(node.func, "attr", None)) in RUNNERS:
            args = [a.value for a in node.args[:2] if isinstance(a, ast.Constant)
                    and isinstance(a.value, str)]
            if len(args) == 2:
                found.add(tuple(args))
    return found


def test_every_command_runs_in_the_suite_or_is_marked():
    run, marked, problems = 0, 0, []
    for block in BLOCKS:
        here = [c for c in block.commands if c.needs is None]
        marked += len(block.commands) - len(here)
        if not here:
            continue
        tests = [runner(f) for f in block.run_by]
        called = set().union(*(runs(t) for t in tests if t is not None))
        if any(runbook == block.runbook and block.starts_with(first) for runbook, first in called):
            run += len(here)
        else:
            problems.append(f"{block.runbook}:{block.line}: {here[0].text[:70]!r}: not marked '# needs:', "
                            f"and not run by {block.run_by or 'any test'}")
    print(f"runbook commands: {run} run in the suite, {marked} marked as needing more than one machine")
    assert not problems, "\n".join(problems)
    assert run >= 20 and marked >= 10, (run, marked)


def test_a_substitution_cannot_make_a_command_another_or_nothing():
    with pytest.raises(AssertionError, match="a substitution makes 'ray stop' another command \\('true'\\)"):
        block_commands("ingest-on-ray.md", "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1", {"ray stop": "true"})
    with pytest.raises(AssertionError, match="another command"):
        block_commands("parallel-filesystems.md", "shards plan --clips 240000",
                       {"shards plan": ": shards plan"})
    assert block_commands("ingest-on-ray.md", "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1",
                          {"6379": "7000"})[1] \
        .startswith("ray start --head --node-ip-address=127.0.0.2 --port=7000 ")  # arguments may change


def test_every_command_of_a_script_must_run_and_the_ledger_names_those_that_did_not(tmp_path, monkeypatch):
    """A script that ends early (``exit 0`` between two commands) fails ``run_commands``; the ledger
    records a block's commands once they exited 0, and ``unexecuted`` names those it lacks."""
    with pytest.raises(AssertionError, match="ran 1 of 3 commands"):
        run_commands(["true", "exit 0", "true"], cwd=tmp_path)
    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv(LEDGER_VAR, str(ledger))
    here = {"tests/test_cluster_runbooks.py"}
    block = block_commands("parallel-filesystems.md", "shards plan --clips 240000")
    before = unexecuted(str(ledger), here)
    assert any(f"{b.runbook}:{b.line}: 'shards plan --clips 240000" in line for line in before for b in BLOCKS
               if b.starts_with("shards plan --clips 240000"))
    run_commands([RunbookCommand("true", c.key) for c in block], cwd=tmp_path)  # as if each had run
    after = unexecuted(str(ledger), here)
    assert len(before) - len(after) == len(block) and set(after) < set(before)


def test_every_runbook_is_listed_and_every_example_command_parses():
    listed = re.findall(r"\]\(([\w.-]+\.md)\)", (ROOT / "docs" / "runbooks" / "README.md").read_text())
    assert sorted(listed) == sorted(p.name for p in RUNBOOKS if p.parent.name == "runbooks"
                                    and p.name != "README.md")
    examples = 0
    for path in RUNBOOKS:
        fences = re.split(r"^```(\w*)\n", path.read_text(), flags=re.M)  # text, lang, code, "", text, ...
        for lang, code in zip(fences[1::2], fences[2::2]):
            if lang and (path.parent.name == "runbooks" or lang == "bash"):  # "": a closing fence
                for argv in project_commands(code):
                    parse(argv)  # every flag exists, whether the command runs here or needs a cluster
                    examples += 1
    assert examples >= 30


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """A directory laid out as after ``scripts/demo.sh``: ``demo/shards``, and a short training run
    as both ``demo/tsm`` and ``demo/tsn`` (what ``trainer plot`` reads, not what it shows, is tested)."""
    root = tmp_path_factory.mktemp("runbooks")
    make_shardset(str(root / "demo" / "shards"), {"train": 8, "val": 4}, per_shard=4, frames=4)
    subprocess.run([sys.executable, "-m", "trainer", "train", "--data", "demo/shards",
                    "--output-dir", "demo/tsm", "--segments", "4", "--depth", "10", "--width", "4",
                    "--crop-size", "32", "--scale-size", "32", "--batch-size", "4", "--epochs", "1",
                    "--warmup-epochs", "0", "--workers", "0", "--no-tensorboard"],
                   cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True,
                   capture_output=True, timeout=300)
    shutil.copytree(root / "demo" / "tsm", root / "demo" / "tsn")
    return root


def test_parallel_filesystems_blocks(demo):
    out = run_block("parallel-filesystems.md", "shards plan --clips 240000", cwd=demo)
    assert "Recommended:" in out
    assert "Recommended:" in run_block("parallel-filesystems.md", "shards plan /lustre/shards/k400", SHARDS,
                                       cwd=demo)
    assert "Recommended:" in run_block("parallel-filesystems.md", "shards plan demo/shards", cwd=demo)
    try:
        run_block("parallel-filesystems.md", "shards reshard /lustre/shards/k400",
                  {"/lustre/shards/k400-1k": "demo/k400-1k", **SHARDS}, cwd=demo)
        assert json.loads((demo / "demo" / "k400-1k" / "manifest.json").read_text())["splits"]
    finally:
        shutil.rmtree(demo / "demo" / "k400-1k", ignore_errors=True)
    out = run_block("parallel-filesystems.md", "shards verify demo/shards", cwd=demo)
    assert "train" in out


def test_recipe_and_loader_bottleneck_blocks(demo):
    out = run_block("recipe-1536-gpus.md", "python bench/scaling.py", cwd=ROOT)
    assert "1536" in out.replace(",", "")
    run_block("loader-bottleneck.md", "trainer plot demo/tsm demo/tsn", cwd=demo)
    assert (demo / "demo" / "tsm-vs-tsn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_service_reuse_block(tmp_path):
    """docs/service.md's build found again from another output directory: nothing decoded the second time."""
    for label in ("jump", "walk"):
        make_video(tmp_path / "k400" / "train" / label / f"{label}.mp4", frames=12, width=40, height=30)
    subs = {"/data/sets": "sets", "/scratch/me": "scratch", "/srv/catalog.sqlite": "catalog.sqlite"}
    out = run_block("../service.md", "ingest build --src k400/", subs, cwd=tmp_path,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert re.search(r"reused dataset \w+ \(k400-r256\) at \S+/sets/k400-r256", out), out[-2000:]
    assert (tmp_path / "sets" / "k400-r256"
            / "manifest.json").is_file() and not (tmp_path / "scratch").exists()


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
        assert (f"{100 * figures['efficiency']:.0f}%" in text
                and f"{figures['clips_per_s']:,.0f}" in text), variant
        assert f"{figures['step_ms']:.1f} ms" in text, variant


def test_layout_figures_quoted_are_what_shards_plan_prints():
    plan = subprocess.run([sys.executable, "-m", "shards", "plan", "--clips", "240000",
                           "--clip-size", "150kB", "--max-world-size", "1536"],
                          capture_output=True, text=True, timeout=120, check=True)
    row = next(line for line in plan.stdout.splitlines() if line.split()[:1] == ["1536"])
    recommended = re.search(r"Recommended: (\d+) shards of ~[\d,]+ clips \(~(\d+) MB\)", plan.stdout)
    opens, total, ratio = re.search(r"\|\s+([\d.]+) \(max.*?\)\s+([\d,]+) \|.*\|\s+([\d,]+x)$", row).groups()
    text = (ROOT / "docs" / "runbooks" / "parallel-filesystems.md").read_text()
    assert f"{recommended[1]} shards of ~{recommended[2]} MB" in text
    assert f"{opens} opens per rank" in text and f"({total} in all)" in text and ratio in text
