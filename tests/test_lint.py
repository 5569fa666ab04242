"""The tree passes ``ruff check`` with pyproject.toml's rules (pyflakes, import order, syntax errors,
lines over 110 characters):
what a reviewer would otherwise catch by eye, caught in the suite (about a second for the tree)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).parent / "ruff"  # from the dev extra, in the suite's venv


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), "check", "--no-cache", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_tree_is_ruff_clean():
    done = ruff(".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_finds_what_its_rules_name(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import sys\nimport os\n\nprint(undefined_name)\n" + f"x = {'1' * 107}\n")
    done = ruff("--config", str(ROOT / "pyproject.toml"), str(planted))
    assert done.returncode == 1
    assert all(code in done.stdout for code in ("I001", "F401", "F821", "E501")), done.stdout
