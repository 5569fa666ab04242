"""The docs run as printed: the demo's "What to run next" list, the shell blocks of README.md and
docs/, and every markdown file's links.

* Each line of the list ``scripts/demo.sh`` prints at its end is run as printed (``$out`` -> a small
  set made here with the demo's own flags): the two-rank ``horovodrun`` on 127.0.0.1, ``ingest
  build`` into a catalog, and the viewer (``shard-service serve``, its page fetched, then stopped).
* The ```bash blocks of README.md and of docs/ outside the runbooks follow the runbooks' rule
  (tests/helpers/runbooks.py): a command runs here, read from the page and run on small data through a
  substitution table, or is marked ``# needs: WHAT``; a block that is neither fails.
* No file git tracks holds a merge-conflict marker, and no markdown file a relative link (or
  image) to a file or an anchor that does not exist.
Each check is shown red on a planted page (``test_the_checks_go_red_...``).

The blocks share one small ``src/`` (module fixture ``small``) and one build of ``shards/k400``,
and run in groups at once (threads, each waiting on its subprocesses; ``started``), with the
tiny training flags of the demo (``TINY``). README's blocks and those of docs/ingest.md and
docs/shards.md are the suite's (about 20 CPU-seconds); the demo's list and docs/trainer.md's
blocks (five trainings, two of them two-rank ``horovodrun``) are marked ``long``, and each
page's "*Run by*" line names its test, so that tests/conftest.py's check holds each stage to
the blocks of the tests it ran (tests/helpers/runbooks.py).
"""
from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.runbooks import PAGES, ROOT, block_commands, ran, run_block, run_commands, runner, shell_env
from helpers.runbooks import parse as parse_blocks

SKIP_DIRS = {".git", ".venv", "demo", "node_modules", "shared", ".mirror"}
# pages other branches add (the lead merges them): links to them count as alive
FUTURE = {ROOT / "docs" / "benchmarks" / "fuzz-video.md",
          ROOT / "docs" / "benchmarks" / "mutation-campaign.md"}
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<img [^>]*src=\"([^\"]+)\"")
TINY = ("--depth 10 --width 16 --crop-size 32 --scale-size 32 --batch-size 4 --epochs 1 "
        "--warmup-epochs 0 --workers 0 --no-tensorboard")


def markdown_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.md") if not SKIP_DIRS & set(p.relative_to(ROOT).parts))


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the text outside code blocks, inline code spans blanked."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in prose(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(path.read_text().splitlines()[_ - 1].lstrip("#").strip())
            k = seen.get(base, 0)
            seen[base] = k + 1
    return {f"{b}-{i}" if i else b for b, n in seen.items() for i in range(n)}


def conflict_markers(path: Path) -> list[str]:
    lines = enumerate(path.read_text().splitlines(), 1)
    return [f"{path.relative_to(ROOT)}:{n}: {line[:20]}" for n, line in lines
            if re.match(r"^(<<<<<<<( |$)|=======$|>>>>>>>( |$)|\|\|\|\|\|\|\| )", line)]


def dead_links(path: Path) -> list[str]:
    dead = []
    for n, line in prose(path.read_text()):
        for m in LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][\w+.-]*:", target):  # http:, mailto: ...: not relative
                continue
            file, _, anchor = target.partition("#")
            where = (path.parent / file).resolve() if file else path
            if where in FUTURE:
                continue
            if not where.exists():
                dead.append(f"{path.relative_to(ROOT)}:{n}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                dead.append(f"{path.relative_to(ROOT)}:{n}: {target} (no such heading)")
    return dead


def unrunnable_blocks(paths: list[Path]) -> list[str]:
    """Shell blocks of ``paths`` with a command that is neither marked ``# needs:`` nor run by the
    test their "*Run by*" line names; and shell fences that are not ```bash (which would escape)."""
    problems = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"^```(sh|shell|console|zsh)\s*$", line.strip()):
                problems.append(f"{path.relative_to(ROOT)}:{n}: a {line.strip()} block: write ```bash")
        for block in parse_blocks(path):
            here = [c for c in block.commands if c.needs is None]
            tests = [runner(f) for f in block.run_by]
            called = set().union(*(runs(t) for t in tests if t is not None))
            if here and not any(page == block.runbook and block.starts_with(first) for page, first in called):
                problems.append(f"{path.relative_to(ROOT)}:{block.line}: {here[0].text[:70]!r}: not marked "
                                f"'# needs:', and not run by {block.run_by or 'any test'}")
    return problems


def runs(test: Path) -> set[tuple[str, str]]:
    """(page, start of the first command) of every block ``test`` runs with tests/helpers/runbooks.py."""
    found = set()
    for node in ast.walk(ast.parse(test.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("run_block", "block_commands"):
            args = [a.value for a in node.args[:2]
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if len(args) == 2:
                found.add(tuple(args))
    return found


def tracked_text_files() -> list[Path]:
    """Every file git tracks that reads as UTF-8 text (code, configs, docs, fixtures' READMEs)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    out = []
    for name in filter(None, names.decode().split("\0")):
        path = ROOT / name
        try:
            path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        out.append(path)
    return out


def test_no_file_in_the_tree_holds_a_conflict_marker():
    files = tracked_text_files()
    found = [m for p in files for m in conflict_markers(p)]
    assert len(files) > 300 and not found, "\n".join(found)


def test_no_relative_link_is_dead():
    found = [d for p in markdown_files() for d in dead_links(p)]
    assert len(markdown_files()) > 20 and not found, "\n".join(found)


def test_every_shell_block_of_readme_and_docs_runs_here_or_is_marked():
    assert ROOT / "README.md" in PAGES and ROOT / "docs" / "trainer.md" in PAGES
    problems = unrunnable_blocks(PAGES)
    assert not problems, "\n".join(problems)


def test_the_checks_go_red_on_a_conflict_a_dead_link_and_an_unrunnable_block(tmp_path):
    page = ROOT / "docs" / f"planted-{os.getpid()}.md"  # inside the repository, where links resolve
    page.write_text("# Planted\n\n<<<<<<< HEAD\na\n=======\nb\n>>>>>>> main\n\n[gone](nowhere.md), "
                    "[no heading](../README.md#no-such-heading), [fine](../README.md#quick-start-debian-12-"
                    "python-311-root-no-gpu-needed), `[code](not-a-link.md)`\n\n"
                    "```bash\ntrainer train --data shards/k400 --output-dir runs/x\n```\n\n"
                    "```bash\n# needs: a cluster\ntrainer train --data /lustre --output-dir runs/y\n```\n")
    try:
        assert len(conflict_markers(page)) == 3
        dead = dead_links(page)
        assert [d.split(": ", 1)[1] for d in dead] == ["nowhere.md (no such file)",
                                                       "../README.md#no-such-heading (no such heading)"], dead
        problems = unrunnable_blocks([page])
        assert len(problems) == 1 and "'trainer train --data shards/k400" in problems[0], problems
    finally:
        page.unlink()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A directory laid out as the demo's ``--out``: ``src/`` made by ``ingest synth`` and ``shards/``
    built from it with the demo's flags (fewer videos); every block below reads this ``src/``."""
    out = tmp_path_factory.mktemp("docs")
    env = {**shell_env(), "OMP_NUM_THREADS": "1"}
    for argv in (["ingest", "synth", "--out", "src", "--classes", "4", "--train-per-class", "4",
                  "--val-per-class", "2", "--width", "64", "--height", "64", "--fps", "10", "--seconds", "2"],
                 ["ingest", "build", "--src", "src", "--out", "shards", "--frames", "4",
                  "--clips-per-video", "4", "--short-side", "32", "--shard-samples", "64"]):
        subprocess.run(argv, cwd=out, env=env, check=True, capture_output=True, timeout=300)
    return out


def demo_next_steps() -> list[str]:
    """The commands of the demo's "What to run next" list, as it prints them (``$out`` unexpanded)."""
    text = (ROOT / "scripts" / "demo.sh").read_text().replace("\\\n", "")
    listed = text[text.index("What to run next"):].split("\nEOF", 1)[0].splitlines()[1:]
    return [line.strip() for line in listed if line.startswith("  ")]


def serve_and_fetch(command: str, cwd: Path, env: dict) -> str:
    """Start a ``shard-service serve`` line (on a free port), fetch the viewer's page at the URL it
    prints, then stop it with Ctrl-C's signal; the page's text."""
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"serving (http://\S+/) ", line)
            if m:
                with urllib.request.urlopen(m[1], timeout=30) as r:
                    assert r.status == 200
                    return r.read().decode()
        raise AssertionError("serve ended without serving:\n" + "".join(seen))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()


def beside(small: Path, name: str) -> Path:
    """A working directory of its own for a group of blocks, with the shared ``src/`` in it."""
    here = small / name
    here.mkdir()
    (here / "src").symlink_to(small / "src")
    return here


def demo_steps(small: Path) -> None:
    """The demo's list, in ``small`` (its ``$out``)."""
    steps = demo_next_steps()
    assert [s.split()[0] for s in steps] == ["trainer", "horovodrun", "ingest", "shard-service"], steps
    assert not any("..." in s for s in steps)
    env = {**shell_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    printed = [s.replace("$out", str(small)) for s in steps]
    run_commands(printed[:3], cwd=ROOT, env=env, timeout=600)
    records = [json.loads(line) for line in (small / "hvd" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r.get("event") == "epoch"] == [1, 2]
    assert (small / "mine" / "manifest.json").is_file()
    assert "<html" in serve_and_fetch(printed[3].replace("--port 8765", "--port 0"), ROOT, env).lower()


def readme_service(here: Path) -> None:
    """README's catalog block: a build registered in a catalog, listed, served (its own directory:
    the demo's list uses a catalog of the same name)."""
    env = {**shell_env(), "OMP_NUM_THREADS": "1"}
    service = block_commands("../../README.md", "ingest build --src kinetics400/ --out sets/k400-r256",
                             {"kinetics400/": "src/"})
    assert "k400-r256" in run_commands(service[:2], cwd=here, env=env)
    assert "<html" in serve_and_fetch(service[2].replace("--port 8765", "--port 0"), here, env).lower()
    ran(service[2])


def pages_builds(here: Path) -> None:
    """README's build of ``shards/k400`` and its ``shards`` block, then docs/ingest.md's build (the
    same command: the finished set is found) and docs/shards.md's block, one after another (both
    write ``sheet.png``)."""
    env = {**shell_env(), "OMP_NUM_THREADS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    subs = {"kinetics400/": "src/", "--workers 32": "--workers 2", "--num-shards 1024": "--num-shards 2"}
    run_block("../../README.md", "ingest build --src kinetics400/ --out shards/k400", subs, cwd=here, env=env)
    assert (here / "shards" / "k400" / "manifest.json").is_file()
    out = run_block("../../README.md", "shards verify shards/k400", cwd=here, env=env)
    assert "Recommended:" in out and (here / "sheet.png").read_bytes()[:4] == b"\x89PNG"
    run_block("../ingest.md", "ingest build --src kinetics400/", subs, cwd=here, env=env)
    out = run_block("../shards.md", "shards plan --clips 240000", subs, cwd=here, env=env)
    assert "Recommended:" in out and (here / "sheet" / "index.html").is_file()


def readme_training(here: Path) -> None:
    env = {**shell_env(), "OMP_NUM_THREADS": "1"}
    run_block("../../README.md", "trainer train --data shards/k400",
              {"--output-dir runs/tsm50": f"--output-dir runs/tsm50 {TINY}",
               "--crops 3": "--crops 1 --workers 0"},
              cwd=here, env=env)


def trainer_page(here: Path) -> None:
    env = {**shell_env(), "OMP_NUM_THREADS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    train = {"runs/tsm50": "runs/d50", "runs/tsn50": "runs/hvd", "--crops 3": "--crops 1 --workers 0",
             "--output-dir runs/d50": f"--output-dir runs/d50 {TINY}",
             "--output-dir runs/hvd": f"--output-dir runs/hvd {TINY}"}
    run_block("../trainer.md", "trainer train --data shards/k400 --output-dir runs/tsm50", train, cwd=here,
              env=env, timeout=600)
    assert (here / "curves.png").read_bytes()[:4] == b"\x89PNG"


def motion_page(here: Path) -> None:
    env = {**shell_env(), "OMP_NUM_THREADS": "1"}
    motion = {"videos/": "src/", "--motion mv": "--motion mv --frames 4 --short-side 32 --clips-per-video 1",
              "--output-dir runs/rgb": f"--output-dir runs/rgb {TINY}",
              "--output-dir runs/motion": f"--output-dir runs/motion {TINY}",
              "--crops 3": "--crops 1 --workers 0"}
    run_block("../trainer.md", "ingest build --src videos/ --out shards/k400-mv", motion, cwd=here, env=env,
              timeout=600)


# The groups of blocks, each test's: a group runs in order; the groups run at once (threads
# waiting on subprocesses), those after a build once it is done; each test waits for its own.
GROUPS = {"test_the_demos_next_steps_run_as_printed": [demo_steps],
          "test_readme_blocks": [pages_builds, readme_training, readme_service],
          "test_docs_pages_blocks": [pages_builds],
          "test_trainer_page_blocks": [pages_builds, trainer_page, motion_page]}


@pytest.fixture(scope="module")
def started(request, small):
    """The groups of the tests selected in this session, started together: ``{group: future}``."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    wanted = {g for name, groups in GROUPS.items() if name in selected for g in groups}
    pages, service = beside(small, "pages"), beside(small, "service")
    where = {demo_steps: small, readme_service: service}
    with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
        futures = {}
        if pages_builds in wanted:
            futures[pages_builds] = pool.submit(pages_builds, pages)
        for group in wanted - {pages_builds}:
            needs_set = group in (readme_training, trainer_page)
            futures[group] = pool.submit(after, futures.get(pages_builds) if needs_set else None, group,
                                         where.get(group, pages))
        yield futures  # (leaving the pool waits for every group: nothing runs past the module)


def after(first: Future | None, group, here: Path) -> None:
    if first is not None:
        first.result()
    group(here)


@pytest.mark.long  # a two-rank training (horovodrun), a build, a server
def test_the_demos_next_steps_run_as_printed(started):
    started[demo_steps].result()


def test_readme_blocks(started):
    for group in GROUPS["test_readme_blocks"]:
        started[group].result()


def test_docs_pages_blocks(started):
    for group in GROUPS["test_docs_pages_blocks"]:
        started[group].result()


@pytest.mark.long  # four trainings (one of two ranks), three evaluations, a plot, a motion build
def test_trainer_page_blocks(started):
    for group in GROUPS["test_trainer_page_blocks"]:
        started[group].result()
