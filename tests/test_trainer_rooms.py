"""The trainer's rooms (docs/architecture.md) import each other in one direction only, read from the
source's import statements: a new import that breaks the order fails here, before it becomes a knot.

    config, errors  <  model, distributed, data  <  schedules  <  the loop (trainer/*.py)

A room imports the rooms it stands above, never one beside or above it, and never the loop; only
the loop (and the rooms) may import ``shards``, and no part of the trainer imports ``ingest`` or ``service``.
"""
from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parent.parent / "trainer"
# trainer.config and trainer.errors stand under every room: they import nothing of the trainer
BASE = {"trainer.config", "trainer.errors"}
ROOMS = {"model": set(), "distributed": set(), "data": set(), "schedules": {"data"}}


def imported_modules(path: Path) -> set[str]:
    """Absolute dotted names of what ``path`` imports (relative imports resolved; lazy ones included)."""
    package = ".".join(path.relative_to(TRAINER.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import x` names a module
    return out


def room_of(module: str) -> str | None:
    """The room of a ``trainer.`` module name, ``"loop"`` for the top level, None outside the trainer."""
    parts = module.split(".")
    if parts[0] != "trainer":
        return None
    if len(parts) == 1:
        return "loop"
    if any(module == b or module.startswith(b + ".") for b in BASE):
        return "base"
    return parts[1] if parts[1] in ROOMS else "loop"


def edges() -> dict[str, set[tuple[str, str]]]:
    """Room -> {(file, imported module)} of its imports of other parts of the trainer."""
    out: dict[str, set] = {}
    for path in sorted(TRAINER.rglob("*.py")):
        own = room_of(".".join(path.relative_to(TRAINER.parent).with_suffix("").parts))
        for module in imported_modules(path):
            other = room_of(module)
            if other is not None and other != own and module not in ("trainer", f"trainer.{other}"):
                out.setdefault(own, set()).add((str(path.relative_to(TRAINER.parent)), module))
    return out


def test_rooms_import_only_the_rooms_below_them():
    wrong = [(path, module) for room, found in edges().items() if room != "loop"
             for path, module in found if room_of(module) not in ROOMS.get(room, set()) | {"base"} - {room}]
    assert wrong == []


def test_the_base_imports_nothing_of_the_trainer():
    assert "base" not in edges()


def test_the_trainer_imports_no_other_package_of_the_project_than_shards():
    wrong = [(str(p), m) for p in TRAINER.rglob("*.py") for m in imported_modules(p)
             if m.split(".")[0] in ("ingest", "service")]
    assert wrong == []


def test_the_rule_is_read_from_real_imports():
    """The graph is not empty: the loop imports every room, and the schedules import the data room."""
    found = edges()
    assert {room_of(m) for _, m in found["loop"]} >= set(ROOMS)
    assert ("trainer/schedules/regime.py", "trainer.data.shapes") in found["schedules"]
