"""The reading-only install, as a user of docs/library.md gets it: a fresh virtual environment (no system
site packages) with torch and the page's install command, nothing else. In it the heavy packages are not
even installed (Ray, aiohttp, OpenCV, Horovod, PyAV, matplotlib, TensorBoard), the crop decoder was built
by the install, and the page's first loop runs from the installed package (not this checkout) against
``shard-service serve`` over HTTP: stopped at an epoch's end, then inside the next epoch, and resumed, with
the batches of an uninterrupted run.

The environment is built once per session in a temporary directory (pip's cache and the machine's local
torch wheel make it about a minute).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers.shardsets import ServiceProcess, make_shardset, register
from test_library import PAGE, ROOT, TRAIN, every_clip_once, keys, run_block

HEAVY = ("ray", "aiohttp", "cv2", "horovod", "av", "ffmpeg", "matplotlib", "tensorboard")


def install_commands() -> list[str]:
    """The page's install commands (the bash blocks of its Install section): torch first (the CPU
    build's line; the CUDA one beside it differs only in its index), then the project."""
    section = PAGE.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    code = "".join(re.findall(r"^```bash\n(.*?)^```$", section, flags=re.S | re.M))
    lines = [x.split("#")[0].strip() for x in code.splitlines() if x.strip()]
    return [x for x in lines if "cu1" not in x]


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    where = tmp_path_factory.mktemp("reading-only") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(where)], check=True, timeout=300)
    pip = [str(where / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check"]
    # torch first, as the page says, but the one build this machine has locally (the CPU index is not
    # reachable from here); the page: any torch >= 2.4 already there stays
    torch_first, project = install_commands()
    expected = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert torch_first == expected, torch_first
    assert project == "pip install ./kinetics-fast", project
    subprocess.run([*pip, "install", "torch==2.13.0"], check=True, timeout=900)
    subprocess.run([*pip, "install", str(ROOT)], check=True, timeout=900, cwd=where.parent)
    return where


@pytest.mark.long
def test_reading_only_install_has_none_of_the_heavy_packages(venv):
    code = ("import importlib.util, sys\n"
            "import trainer.data as d\n"
            "from trainer.data import cropdecode\n"
            "d.ClipLoader, d.ClipDataset, d.normalise\n"
            f"print([m for m in {HEAVY!r} if importlib.util.find_spec(m) or m in sys.modules])\n"
            "print(d.__file__)\n"
            "print(cropdecode.available())\n")
    run = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=venv.parent, env={"PATH": os.environ["PATH"]})
    assert run.returncode == 0, run.stderr
    heavy, where, crop = run.stdout.splitlines()
    assert heavy == "[]" and where.startswith(str(venv)) and crop == "True", run.stdout


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from shards.catalog import Catalog

    root = tmp_path_factory.mktemp("served")
    make_shardset(str(root / "set"), {"train": TRAIN}, per_shard=5)
    catalog = Catalog(str(root / "catalog.sqlite"))
    register(catalog, str(root / "set"), "kinetics400")
    server = ServiceProcess("--catalog", catalog.path)
    server.start()
    yield str(root / "set"), f"{server.url}/v1/datasets/kinetics400"
    server.kill(15)


@pytest.mark.long
def test_the_documented_loop_reads_the_service_and_resumes(venv, served, tmp_path):
    directory, url = served
    python = (str(venv / "bin" / "python"),)
    env = {"PYTHONPATH": "", "PATH": os.environ["PATH"]}  # the installed package, not this checkout
    (tmp_path / "whole").mkdir()
    (tmp_path / "cut").mkdir()
    whole = keys(run_block("max_steps = int(os.environ", url, tmp_path / "whole", env=env, command=python))
    every_clip_once(whole, directory)
    runs = [keys(run_block("max_steps = int(os.environ", url, tmp_path / "cut", env={**env, **more},
                           command=python))
            for more in ({"MAX_STEPS": "3"}, {"MAX_STEPS": "1"}, {})]
    assert [len(r) for r in runs] == [3, 1, 2] and sum(runs, []) == whole
