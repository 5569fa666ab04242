"""The import graph of the project's four packages, read from their source: no module imports
itself round a circle (lazy imports inside functions count: they only hide a circle), and the
packages depend on each other in one direction only, with ``shards`` at the bottom; the wings of
``shards`` and ``ingest`` (docs/architecture.md) stand on their floors, each importing only the
wings beneath it; and the most basic helper, ``shards.io.storage``, loads no HTTP client."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ingest", "shards", "trainer", "service")
ALLOWED = {"shards": set(), "ingest": {"shards"}, "trainer": {"shards"}, "service": {"shards", "ingest"}}
# wing -> the wings it may import besides its own modules (a wing of another package is named whole:
# "shards.base"); the top of a package (its __init__, __main__, cli and, in ingest, the build) may
# import any wing of it
BASE, IO, FORMAT, PLAN, READ = "shards.base", "shards.io", "shards.format", "shards.plan", "shards.read"
FLOORS = {
    BASE: set(),  # errors, the command framework, progress, words, units
    IO: {BASE},  # storage, the range client
    FORMAT: {BASE, IO},  # the bytes of a set (a manifest is loaded and a shard written through io)
    # pure, integers and lists in: who reads what, the layout (not even the format, which reads)
    PLAN: {BASE},
    READ: {BASE, IO, FORMAT, PLAN},  # reading samples, the node cache, direct reads, the clip index
    "shards.catalog": {BASE, IO, FORMAT},
    "shards.tools": {BASE, IO, FORMAT, PLAN, READ},  # the commands: anything of shards but the catalog
    "ingest.decode": {BASE, IO, FORMAT},  # a video's frames: nothing of the build around them
    "ingest.tasks": {BASE},  # where the build's tasks run, knowing nothing of what they do
}
# what stays at a package's top; a new module goes into a wing (or is named here with its reason)
TOPS = {"shards": {"shards", "shards.__main__", "shards.cli"}}


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (a package is its ``__init__``)."""
    files = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:  # the project module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                               for a in node.names)
        graph[module] = {m for m in map(owner, targets) if m and m != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_finds_a_lazy_circle_and_a_relative_import(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("from .leaf import f\n")
    (tmp_path / "pkg" / "sub" / "leaf.py").write_text("def f():\n    from ..top import g\n")
    (tmp_path / "pkg" / "top.py").write_text("from pkg.sub import f\n\ndef g():\n    pass\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.sub"] == {"pkg.sub.leaf"} and graph["pkg.sub.leaf"] == {"pkg.top"}
    assert circles(graph) == [["pkg.sub", "pkg.sub.leaf", "pkg.top"]]


def test_no_module_of_the_project_imports_itself_round_a_circle():
    assert circles(import_graph(ROOT)) == []


def test_packages_depend_downwards_only_and_shards_on_none_of_the_others():
    graph = import_graph(ROOT)
    used = {p: set() for p in PACKAGES}
    for module, targets in graph.items():
        for target in targets:
            used[module.split(".")[0]].add(target.split(".")[0])
    beyond = {p: sorted(used[p] - ALLOWED[p] - {p}) for p in PACKAGES if used[p] - ALLOWED[p] - {p}}
    assert beyond == {}


def wing_of(module: str) -> str | None:
    return next((w for w in FLOORS if module == w or module.startswith(w + ".")), None)


def breaches(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, import) of every import of a wing's module that its floor does not allow: a wing of
    the project not in ``FLOORS[wing]``, or a module of its package's top."""
    out = []
    for module, targets in graph.items():
        wing = wing_of(module)
        if wing is None:
            continue
        for target in targets:
            other = wing_of(target)
            mine = target.split(".")[0] == wing.split(".")[0]
            if other == wing or (other is None and not mine) or other in FLOORS[wing]:
                continue
            out.append((module, target))
    return sorted(out)


def test_every_wing_imports_only_the_wings_beneath_it():
    assert breaches(import_graph(ROOT)) == []


def test_an_upward_import_breaks_the_floor_it_crosses():
    graph = import_graph(ROOT)
    assert breaches(graph) == []
    planted = {
        ("shards.base.errors", "shards.read.reading"),  # base imports nothing of shards
        ("shards.io.storage", "shards.format.manifest"),  # io stands under format
        ("shards.plan.partition", "shards.io.http_range"),  # plan is pure
        ("shards.format.sample", "shards.tools.verify"),  # nothing but the top imports a tool
        ("shards.read.cache", "shards.catalog.store"),
        ("ingest.decode.pyav_decoder", "ingest.clips"),  # the decoders know nothing of the build
        ("ingest.tasks.runtime", "ingest.decode.video"),
        ("shards.base.words", "shards.cli"),  # nor of its package's top
    }
    for module, target in planted:
        assert breaches({**graph, module: graph[module] | {target}}) == [(module, target)]


def test_a_new_module_of_shards_goes_into_a_wing():
    loose = sorted(m for m in import_graph(ROOT, ("shards",)) if wing_of(m) is None
                   and m not in TOPS["shards"])
    assert loose == [], f"{loose}: put each into the wing of shards/ it belongs to (docs/architecture.md)"


def test_the_basic_path_helper_loads_no_http_client():
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, shards.io.storage; print(' '.join(sorted(sys.modules)))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert "shards.io.storage" in loaded
    assert [m for m in loaded if m.startswith(("shards.read.reading", "shards.io.http_range", "http.client",
                                               "aiohttp"))] == []


ROOMS = ("shards", "ingest", "service", "trainer/data")
LONG_FILE = 350  # lines: above this a module of ROOMS says in its docstring why it stays one file


def oversized(root: Path) -> list[str]:
    """The modules of ``ROOMS`` over ``LONG_FILE`` lines whose docstring has no paragraph opening
    "Why one file" (the house's answer to "why is this not two modules?")."""
    out = []
    for room in ROOMS:
        for path in sorted((root / room).rglob("*.py")):
            text = path.read_text()
            if text.count("\n") <= LONG_FILE:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not any(p.startswith("Why one file") for p in doc.split("\n\n")):
                out.append(str(path.relative_to(root)))
    return out


def test_a_long_module_says_why_it_stays_one_file(tmp_path):
    assert oversized(ROOT) == []
    (tmp_path / "shards").mkdir()
    body = "x = 1\n" * LONG_FILE
    (tmp_path / "shards" / "long.py").write_text('"""A module."""\n' + body)
    (tmp_path / "shards" / "said.py").write_text('"""A module.\n\nWhy one file: one protocol."""\n' + body)
    (tmp_path / "shards" / "short.py").write_text('"""A module."""\n' + "x = 1\n" * (LONG_FILE - 2))
    assert oversized(tmp_path) == ["shards/long.py"]
