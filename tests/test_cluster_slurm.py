"""The Slurm runbook's batch script, run for real by a one-node Slurm cluster on loopback.

Debian's slurm-wlm and munge: ``docs/runbooks/slurm/local-slurm.sh`` starts munged, slurmctld and
slurmd with the node at 127.0.0.1, and ``sbatch`` runs ``docs/runbooks/slurm/train.sbatch`` as the
runbook shows: Slurm allocates two tasks, the script launches two Horovod ranks over the
allocation with horovodrun, and trains from a shard set into ``runs/<job id>`` with the
node-local cache under the job's ``$TMPDIR``. The test watches the job with ``scontrol`` every
half second (``sbatch --wait`` polls at growing intervals, up to 10 s).
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
import time
from pathlib import Path

import pytest
from shardsets import make_shardset

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "docs" / "runbooks" / "slurm"

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch")) or os.geteuid() != 0,
    reason="needs Debian's slurm-wlm and munge (apt-get install slurm-wlm munge), run as root")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def slurm():
    state = tempfile.mkdtemp(prefix="kf-slurm-")
    ports = {"SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port())}
    start = subprocess.run(["bash", str(SLURM / "local-slurm.sh"), "start", state], capture_output=True,
                           text=True, timeout=120, env={**os.environ, **ports})
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        yield {**os.environ, "SLURM_CONF": f"{state}/slurm.conf"}
    finally:
        subprocess.run(["bash", str(SLURM / "local-slurm.sh"), "stop", state], timeout=60)
        shutil.rmtree(state, ignore_errors=True)


def finished(job_id: str, env: dict, timeout: float = 300) -> str:
    """The job's ``scontrol show job`` line once it has left the queue and stopped running."""
    deadline = time.monotonic() + timeout
    while True:
        line = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                              timeout=60).stdout
        if re.search(r"JobState=(?!PENDING|CONFIGURING|RUNNING|COMPLETING)", line):
            return line
        assert time.monotonic() < deadline, f"job {job_id} still not done after {timeout} s: {line}"
        time.sleep(0.5)


def test_runbook_sbatch_script_trains_under_slurm(slurm, tmp_path):
    make_shardset(str(tmp_path / "data"), {"train": 16, "val": 6}, per_shard=4, num_classes=3, frames=4,
                  size=(40, 32))
    env = {**slurm, "KF_LAUNCH": "horovodrun", "KF_VENV": str(Path(sys.executable).parent.parent),
           "TMPDIR": str(tmp_path / "node-local"), "OMP_NUM_THREADS": "1"}
    (tmp_path / "node-local").mkdir()
    submit = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", f"--chdir={tmp_path}",
         str(SLURM / "train.sbatch"), "--data", "data", "--segments", "4", "--depth", "10", "--width", "8",
         "--crop-size", "32", "--scale-size", "32", "--batch-size", "2", "--epochs", "2", "--warmup-epochs", "1",
         "--workers", "1", "--no-tensorboard"], env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    job = finished(job_id, env)
    log = (tmp_path / f"kf-train-{job_id}.out").read_text()
    assert "JobState=COMPLETED" in job and "ExitCode=0:0" in job, job + log[-3000:]
    assert "2 ranks, launcher horovodrun" in log, log[-2000:]

    run = tmp_path / "runs" / job_id
    epochs = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and all(r["val_samples"] == 6 for r in epochs)
    assert (run / "checkpoint.pt").stat().st_size > 0
    assert list((tmp_path / "node-local" / "kinetics-fast-cache").rglob("*.tar"))  # the node-local cache
