"""The training benchmarks' data and runs, through the command-line tools.

``synth_shards`` makes ``ingest synth`` videos and ingests them with ``ingest build`` (each once per
work directory: a rerun reuses them); ``start_training`` starts ``trainer train`` on one process or
on Horovod ranks (gloo), its output in a log beside the run's directory and its command line in a
file beside that (``finished`` reads both: a campaign rerun keeps the runs already done with the same
command). Used by ``bench/schedules.py`` and ``bench/two_stream.py``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENV = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(ROOT)}  # a local Ray for each build


def synth_shards(videos: Path, shards: Path, synth: list[str], build: list[str]) -> Path:
    """``ingest synth --out VIDEOS SYNTH...`` then ``ingest build --src VIDEOS --out SHARDS BUILD...``,
    each skipped when its output is already there; returns ``shards``."""
    if (shards / "manifest.json").exists():
        return shards
    if not videos.exists():
        subprocess.run([str(BIN / "python"), "-m", "ingest", "synth", "--out", str(videos), *synth],
                       check=True, env=ENV)
    subprocess.run([str(BIN / "python"), "-m", "ingest", "build", "--src", str(videos), "--out", str(shards),
                    *build], check=True, env=ENV)
    return shards


def training_command(data: Path, out: Path, flags: list[str], ranks: int = 1,
                     hosts: str | None = None) -> list[str]:
    """``trainer train --data DATA --output-dir OUT FLAGS...``: on ``ranks`` Horovod ranks (gloo;
    horovodrun's ``-H`` is ``hosts``, default all on localhost) when more than one, else one process
    (``--backend none``)."""
    launcher = ([str(BIN / "horovodrun"), "-np", str(ranks), "-H", hosts or f"localhost:{ranks}", "--gloo"]
                if ranks > 1 else [])
    backend = [] if ranks > 1 else ["--backend", "none"]
    return [*launcher, str(BIN / "python"), "-m", "trainer", "train", "--data", str(data), "--output-dir",
            str(out), *backend, *flags]


def start_training(data: Path, out: Path, flags: list[str], ranks: int = 1,
                   hosts: str | None = None) -> subprocess.Popen:
    """``training_command`` in a fresh OUT, one thread per rank. Its output goes to OUT.log, its
    command line to OUT.cmd.json."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = training_command(data, out, flags, ranks, hosts)
    out.with_suffix(".cmd.json").write_text(json.dumps(cmd))
    with open(out.with_suffix(".log"), "w") as log:
        return subprocess.Popen(cmd, env={**ENV, "OMP_NUM_THREADS": "1"}, stdout=log,
                                stderr=subprocess.STDOUT)


def finished(out: Path, cmd: list[str] | None = None) -> bool:
    """Whether the run in OUT ended well (its log says done) and, given ``cmd``, was started by that
    very command line."""
    log, recorded = out.with_suffix(".log"), out.with_suffix(".cmd.json")
    if not log.exists() or "trainer.train: done:" not in log.read_text(errors="replace"):
        return False
    return cmd is None or (recorded.exists() and json.loads(recorded.read_text()) == cmd)
