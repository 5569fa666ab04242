"""``ingest build --address`` on a real two-node Ray cluster kept on loopback.

A head and a worker node (``ray.cluster_utils.Cluster``: separate raylets, object stores and
worker processes, all on 127.0.0.1; ../shared/notes/loopback.md), one CPU each, and the build
launched as a user launches it: the ``ingest`` command in its own process, joining the cluster by
address. The shards must be byte-identical to an embedded single-node build, with tasks run on
both nodes (the build's summary counts tasks per Ray node id), and the cluster build registered by
name in a dataset catalog as docs/runbooks/service.md has it (``--catalog``, ``--name``). Then the worker node
is killed (SIGKILL to its raylet and workers) in the middle of a second build: Ray retries the lost tasks
on the head, and the build finishes with the same bytes.
"""
from __future__ import annotations

import contextlib
import filecmp
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from helpers.media import make_video
from helpers.runbooks import run_block
from ray.cluster_utils import Cluster

from shards.catalog import Catalog

HOLDPOINT = str(Path(__file__).with_name("helpers") / "holdpoint.py")
WAIT_FOR_NODES = shlex.quote(str(Path(__file__).with_name("helpers") / "ray_nodes.py"))
VIDEOS = 16  # one video per decode task: enough tasks to kill the worker node among them
BUILD = ["--frames", "4", "--short-side", "32", "--shard-samples", "5", "--videos-per-task", "1",
         "--splits", "train,val"]
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("videos")
    for i in range(VIDEOS):
        split = "val" if i % 4 == 3 else "train"
        make_video(src / split / f"class_{i % 2}" / f"v{i:02d}.mp4", frames=20 + i, width=48, height=32)
    return src


@pytest.fixture(scope="module")
def cluster():
    # its own temp dir, so no other ray.init() on this machine finds and joins this cluster
    temp_dir = tempfile.mkdtemp(prefix="kf-ray-")  # short: Ray's socket paths must fit in 107 bytes
    node = dict(num_cpus=1, object_store_memory=80 * 2**20, temp_dir=temp_dir)
    c = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    worker = c.add_node(**node)
    c.wait_for_nodes()
    yield c, worker
    c.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def ingest(src: Path, out: Path, *extra: str, env: dict | None = None,
           hold: str | None = None) -> subprocess.Popen:
    """``ingest build`` in its own process; ``hold``: run it under tests/helpers/holdpoint.py at that
    target."""
    argv = [sys.executable, *([HOLDPOINT, hold] if hold else []), "-m", "ingest", "build", "--src", str(src),
            "--out", str(out), *BUILD, *extra]
    return subprocess.Popen(argv, env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            text=True)


def finish(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    return output


def tasks_per_node(output: str) -> dict[str, int]:
    match = re.search(r"tasks on (\d+) nodes: (.*)$", output, re.MULTILINE)
    assert match, "\n".join(line for line in output.splitlines() if "ray stop" not in line
                            and "stopped" not in line and "termination" not in line)[-4000:]
    return {node: int(n) for node, n in (item.split() for item in match.group(2).split(", "))}


def assert_same_files(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b and any(p.suffix == ".tar" for p in files_a)
    match, mismatch, errors = filecmp.cmpfiles(a, b, [str(p) for p in files_a], shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


@pytest.fixture(scope="module")
def embedded(videos, tmp_path_factory) -> Path:
    """The same build on an embedded single-node Ray: the bytes every cluster build must give."""
    out = tmp_path_factory.mktemp("embedded") / "shards"
    finish(ingest(videos, out, "--workers", "2"))
    return out


def wait_for(condition, proc: subprocess.Popen, what: str, seconds: float = 120) -> None:
    """Until ``condition()`` (a file the build writes); fails if the build ends first or never gets there."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, f"the build ended before {what}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_nodes(temp_dir: str) -> None:
    """Stop the Ray nodes started with ``--temp-dir=temp_dir`` and their workers (``ray stop`` would
    stop every Ray of the machine): the processes naming the directory, and their descendants."""
    procs = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if temp_dir in " ".join(p.info["cmdline"] or []):
                procs += [p, *p.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    for p in psutil.wait_procs(procs, timeout=30)[1]:
        with contextlib.suppress(psutil.Error):
            p.kill()


def test_the_runbooks_two_node_loopback_build(videos, embedded, tmp_path):
    """docs/runbooks/ingest-on-ray.md's block as a reader pastes it: two ``ray start`` nodes on
    127.0.0.2 and 127.0.0.3, the build joining them by address, and ``ray stop``. The block runs in
    a PID namespace of its own (``run_block(own_processes=True)``), where ``ray stop``, which stops
    every Ray node it can see, sees the block's two alone."""
    temp_dir, port = tempfile.mkdtemp(prefix="kf-ray-"), free_port()
    subs = {"ray start --head": f"ray start --head --temp-dir={temp_dir}",  # this test's nodes, found by it
            "6379": str(port), "8265": str(free_port()), "10001": str(free_port()),  # free ports
            "--src videos": f"--src {videos}",
            # a hold point: the build starts once the cluster lists both nodes, as a reader's `ray status`
            # would show them (`ray start` returns before the node has registered: a build started at once
            # on a loaded machine saw the head alone and ran every task there)
            "--node-ip-address=127.0.0.3 --num-cpus=1": "--node-ip-address=127.0.0.3 --num-cpus=1 && "
                                                       f"{shlex.quote(sys.executable)} {WAIT_FOR_NODES} "
                                                       f"127.0.0.2:{port} 2"}
    try:
        out = run_block("ingest-on-ray.md", "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1", subs, cwd=tmp_path,
                        env=ENV, own_processes=True)
        assert "Stopped all" in out, out[-2000:]  # ray stop found the block's nodes and stopped them
    finally:
        stop_nodes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    # the build joined both nodes; which node ran which task is Ray's to decide: a build of one
    # second may finish on the first node's worker before the other node's first worker has
    # started (a worker serves one job: none can be warmed for the build), so that both run tasks
    # is the next test's, which holds a task on the worker node
    assert "Ray: 2 CPUs in the cluster, 2 tasks at a time" in out, out[-3000:]
    assert_same_files(embedded, tmp_path / "shards")


def test_two_node_build_uses_both_nodes_and_survives_losing_the_worker(videos, embedded, cluster, tmp_path):
    c, worker = cluster
    catalog = str(tmp_path / "catalog.sqlite")
    both = finish(ingest(videos, tmp_path / "cluster", "--address", c.address, "--catalog", catalog,
                         "--name", "two-nodes"))
    # where the tasks ran is Ray's to decide: a build of one second may finish on the head before the
    # worker node's first task has started its Python (the held task below is one the worker runs)
    if "tasks on 2 nodes" in both:
        counts = tasks_per_node(both)
        assert set(counts) == {c.head_node.node_id[:12], worker.node_id[:12]}, counts
        assert sum(counts.values()) == VIDEOS + 4, counts  # decode tasks + pack tasks (3 train shards, 1 val)
    assert_same_files(embedded, tmp_path / "cluster")
    record = Catalog(catalog).resolve("two-nodes")
    assert record.state == "ready" and record.location == str(tmp_path / "cluster")
    assert sum(s["clips"] for s in record.splits.values()) == VIDEOS

    # the worker node dies under a decode task it runs (held there: tests/helpers/holdpoint.py), with most
    # of the build still to come; Ray runs that task again on the head
    out, marker = tmp_path / "lost-worker", tmp_path / "held-task"
    proc = ingest(videos, out, "--address", c.address, hold="ingest.staging:decode_batch",
                  env={"HOLD_ON_NODE": worker.node_id, "HOLD_MARKER": str(marker)})
    try:
        wait_for(lambda: marker.exists() and marker.read_text(), proc,
                 "a decode task held on the worker node")
        held = psutil.Process(int(marker.read_text()))
        staged_at_kill = len(list(out.glob(".staging/*.json")))
        c.remove_node(worker, allow_graceful=False)
        assert not worker.any_processes_alive()
        assert not psutil.wait_procs([held], timeout=60)[1]  # the held task's worker ends with its node
        finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert staged_at_kill < VIDEOS
    assert_same_files(embedded, out)
