"""The Slurm runbook's block (docs/runbooks/training.md), run as written by a one-node Slurm cluster
on loopback.

Debian's slurm-wlm and munge: ``docs/runbooks/slurm/local-slurm.sh`` starts munged, slurmctld and
slurmd with the node at 127.0.0.1, and ``sbatch --wait`` runs ``docs/runbooks/slurm/train.sbatch``:
Slurm allocates two tasks, the script launches two Horovod ranks over the allocation with
horovodrun, and trains from the demo's shard set into ``runs/<job id>`` with the node-local cache
under the job's ``$TMPDIR``; then the block stops the cluster. It runs in a directory laid out as
the checkout after the demo; the one substitution: the cluster's state directory (and its ports,
by the environment) are this test's own, so that nothing of another run is touched.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers.required import require
from helpers.runbooks import run_block
from helpers.shardsets import make_shardset

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "docs" / "runbooks" / "slurm"

MISSING = None if all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged",
                                                "sbatch")) and os.geteuid() == 0 \
    else "needs Debian's slurm-wlm and munge (apt-get install slurm-wlm munge), run as root"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def state():
    """The cluster's state directory; its daemons stopped at the end whatever the block did. (The
    test command, scripts/test.sh, installs Slurm and requires it: tests/helpers/required.py.)"""
    require("slurm", MISSING)
    state = tempfile.mkdtemp(prefix="kf-slurm-")
    try:
        yield state
    finally:
        subprocess.run(["bash", str(SLURM / "local-slurm.sh"), "stop", state], timeout=60)
        shutil.rmtree(state, ignore_errors=True)


# long: 45 s on 2 cores (a Slurm cluster started, a two-rank Horovod job, the cluster stopped); the suite
# keeps horovodrun's own two-rank run (tests/test_horovod.py) and the runbook's Ray cluster
@pytest.mark.long
def test_runbook_block_trains_under_slurm(state, tmp_path):
    (tmp_path / "docs").symlink_to(ROOT / "docs")  # the checkout after the demo
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    make_shardset(str(tmp_path / "demo" / "shards"), {"train": 16, "val": 6}, per_shard=4, num_classes=3,
                  frames=4, size=(40, 32))
    (tmp_path / "node-local").mkdir()
    env = {**os.environ, "SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port()),
           "TMPDIR": str(tmp_path / "node-local"), "OMP_NUM_THREADS": "1"}
    out = run_block("training.md", "bash docs/runbooks/slurm/local-slurm.sh start",
                    {"/tmp/kinetics-fast-slurm": state}, cwd=tmp_path, env=env, timeout=480)
    job = re.search(r"^JobId=(\d+) .*$", out, re.MULTILINE)
    assert job, out[-3000:]
    log = (tmp_path / f"kf-train-{job[1]}.out").read_text()
    assert "JobState=COMPLETED" in job[0] and "ExitCode=0:0" in job[0], job[0] + log[-3000:]
    assert "2 ranks, launcher horovodrun" in log, log[-2000:]

    run = tmp_path / "runs" / job[1]
    epochs = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and all(r["val_samples"] == 6 for r in epochs)
    assert (run / "checkpoint.pt").stat().st_size > 0
    assert list((tmp_path / "node-local" / "kinetics-fast-cache").rglob("*.tar"))  # the node-local cache
