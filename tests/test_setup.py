"""The set-up is idempotent: run twice in a row, the second run of ``scripts/setup.sh`` changes nothing.

It runs against the virtual environment the README's first command makes in this checkout
(``.venv``, or ``$VENV``), the one the test command itself runs in. Nothing may be reinstalled or
rebuilt the second time, which is seen in the files: every file of the environment keeps its inode,
size and modification time (a reinstall writes new files; Python's bytecode caches are left out).
``import PIL`` must still be pillow-simd, with no stock Pillow installed beside it: a dependency
re-resolution brought Pillow back over it on every run before.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers.runbooks import run_block

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VENV", ROOT / ".venv"))
if not VENV.is_absolute():
    VENV = ROOT / VENV


def files(venv: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under ``venv`` (bytecode caches aside): path -> (inode, size, mtime in ns)."""
    found = {}
    for directory, dirs, names in os.walk(venv):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            st = os.lstat(os.path.join(directory, name))
            found[os.path.join(directory, name)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return found


def setup() -> str:
    """The runbooks' set-up block (docs/runbooks/loader-bottleneck.md) in the checkout; its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return run_block("loader-bottleneck.md", "bash scripts/setup.sh", cwd=ROOT,
                     env={**env, "VENV": str(VENV)},
                     activated=False, timeout=1800)


@pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                    reason=f"no {VENV}: scripts/setup.sh has not been run in this checkout")
def test_second_setup_run_changes_nothing_and_pil_stays_pillow_simd():
    setup()  # the first run: a no-op too when the test command has just set up
    before = files(VENV)
    second = setup()
    after = files(VENV)
    assert "nothing to do" in second, second
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, f"{len(changed)} files changed by the second run, e.g. {changed[:10]}"

    which = subprocess.run([str(VENV / "bin" / "python"), "-c", (
        "import importlib.metadata as m, PIL\n"
        "stock = [d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].lower() == 'pillow']\n"
        "print(m.version('pillow-simd'), PIL.__version__, stock, PIL.__file__)")],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]})
    simd, pil, stock, path = which.stdout.split(maxsplit=3)
    assert (which.returncode == 0 and simd == pil and ".post" in pil
            and stock == "[]"), which.stdout + which.stderr
    assert path.strip().startswith(str(VENV))
