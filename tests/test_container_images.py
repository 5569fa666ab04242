"""The CPU image built and run for real with podman, as docs/runbooks/containers.md says.

The base is made from Debian bookworm's packages (``docker/debian-base.sh``: no image registry is
reachable here), ``docker/Dockerfile`` builds on it through ``scripts/setup.sh`` with the host's pip
cache mounted, and in the image the pipeline runs: ``ingest synth`` + ``ingest build`` into the
catalog + ``shards verify`` + one epoch of ``trainer train`` on a named volume, then
``shard-service serve`` in one container and a trainer in another streaming the set from it over
loopback. Every command is the runbook's, read from it when the test runs; the substitution table
adds only what podman needs on this kind of VM (/work/shared/notes/containers.md: runc, cgroupfs,
explicit ulimits, host networking for the build, the host's CA bundle and pip configuration) and
names the volume, the service's container and its port for this run. Marked ``containers``:
scripts/test.sh runs it after the long stage (a cold build takes many minutes; a warm one, with the
base and the image's layers cached, seconds). Where podman cannot run it skips saying why, unless
``KF_REQUIRE_PODMAN`` is set (scripts/test.sh sets it), where it fails.
"""
from __future__ import annotations

import importlib.metadata as m
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import tomllib
from helpers.fronts import free_port
from helpers.required import require
from helpers.runbooks import run_block
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "kinetics-fast:cpu"
BUILD_STAGE_LABEL = "org.kinetics-fast.stage=build"  # docker/Dockerfile's first stage
pytestmark = [pytest.mark.containers, pytest.mark.timeout(3600)]


def podman_flags() -> str:
    """podman's global flags on this kind of VM: crun refuses its hybrid cgroups, systemd is not the
    cgroup manager."""
    return "--runtime runc --cgroup-manager cgroupfs"


def ulimits() -> str:
    """Explicit limits at or below the host's hard ones (podman's defaults exceed them and the
    container fails to start); runc here refuses a process limit above 32768 whatever the host's."""
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    procs = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    return f"--ulimit nofile={files}:{files} --ulimit nproc={procs}:{procs}"


def pip_mounts() -> str:
    """The host's pip configuration, read-only, and every local path it names (CA bundle,
    constraints, find-links, file:// indexes): so that pip in the build finds what pip on the host
    finds (here: a private CA in the path to PyPI, local wheel directories)."""
    pip = [sys.executable, "-m", "pip", "config"]
    debug = subprocess.run([*pip, "debug"], capture_output=True, text=True, timeout=60).stdout
    paths = set(re.findall(r"^\s+(\S+), exists: True$", debug, re.M))
    listed = subprocess.run([*pip, "list"], capture_output=True, text=True, timeout=60).stdout
    for value in re.findall(r"='([^']*)'$", listed, re.M):
        for word in value.split():
            path = word.removeprefix("file://")
            if path.startswith("/") and os.path.exists(path):
                paths.add(path.rstrip("/").removesuffix("/simple") if word.startswith("file://") else path)
    return " ".join(f"-v {p}:{p}:ro" for p in sorted(paths))


def pip_cache() -> str:
    return subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *podman_flags().split(), *args], capture_output=True, text=True,
                          timeout=timeout, check=check)


def podman_missing() -> str | None:
    """Why podman cannot build and run images here, or None."""
    tools = [t for t in ("podman", "runc", "debootstrap", "curl") if shutil.which(t) is None]
    if tools:
        return f"{', '.join(tools)} not installed (apt-get install podman runc debootstrap curl)"
    if os.geteuid() != 0:
        return "debootstrap and this VM's podman set-up need root"
    info = subprocess.run(["podman", *podman_flags().split(), "info"], capture_output=True, text=True,
                          timeout=120)
    if info.returncode != 0:
        return f"podman info failed: {info.stderr.strip()[-300:]}"
    return None


def conmons(names: list[str]) -> list[psutil.Process]:
    """conmon processes still watching one of the containers ``names``."""
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "conmon" and any(n in " ".join(p.info["cmdline"] or []) for n in names):
            found.append(p)
    return found


@pytest.fixture(scope="module")
def image() -> str:
    """The base (kept once made) and the CPU image, built by the runbook's commands; the build's
    output. The image this replaces is removed, and so are the build stages but the newest (its
    cache: the one a build of the same sources reuses)."""
    require("podman", podman_missing())
    subs = {"podman build ": f"podman build --network host {ulimits()} {pip_mounts()} ",
            "/root/.cache/pip:": f"{pip_cache()}:",
            "podman ": f"podman {podman_flags()} "}
    before = podman("image", "inspect", "--format", "{{.Id}}", IMAGE, check=False).stdout.strip()
    out = run_block("containers.md", "bash docker/debian-base.sh", subs, cwd=ROOT, timeout=3300)
    if before and before != podman("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip():
        podman("rmi", before, check=False)  # the last run's image, untagged now: 2.7 GB each run otherwise
    stages = podman("images", "--quiet", "--no-trunc", "--sort", "created", "--filter", "dangling=true",
                    "--filter", f"label={BUILD_STAGE_LABEL}").stdout.split()  # newest first
    for stage in stages[1:]:
        podman("rmi", stage, check=False)  # 3.4 GB each otherwise
    return out


@pytest.fixture
def names():
    """This run's volume and service container, removed on every path; afterwards no conmon of
    theirs is left."""
    run = uuid.uuid4().hex[:8]
    made = {"volume": f"kf-data-{run}", "service": f"kf-service-{run}"}
    yield made
    podman("rm", "-f", "-t", "5", made["service"], check=False)
    podman("volume", "rm", "-f", made["volume"], check=False)
    _, alive = psutil.wait_procs(conmons(list(made.values())), timeout=30)
    assert not alive, f"conmon left running: {alive}"


def requirement_names(extras: list[str]) -> set[str]:
    """The distributions pyproject.toml names in ``extras`` (\"base\": its dependencies)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lists = {"base": project["dependencies"], **project["optional-dependencies"]}
    return {canonicalize_name(Requirement(r).name) for extra in extras for r in lists[extra]}


def test_image_is_the_unprivileged_user_and_the_hosts_install_without_its_tools(image):
    """The image runs as 10001 and its .venv holds what setup.sh installs on the host but the dev
    extra: every distribution at the host's version (constraints.txt, pillow-simd over Pillow,
    Horovod with Gloo), none that only the tests and linters need; no compiler and no apt cache in
    the image; its HEALTHCHECK is set and passes."""
    inspected = json.loads(podman("image", "inspect", IMAGE).stdout)[0]
    config = inspected["Config"]
    assert config["User"] == "10001:10001" and config["Cmd"] == ["ingest", "--help"], config
    # podman keeps a HEALTHCHECK only in the docker format (the runbook's --format docker)
    check = (inspected.get("Healthcheck") or {}).get("Test", [])
    assert check[:1] == ["CMD"], inspected.get("Healthcheck")
    podman("run", "--rm", *ulimits().split(), IMAGE, *check[1:], timeout=300)
    tools = podman("run", "--rm", *ulimits().split(), IMAGE, "sh", "-c",
                   "for t in gcc cc g++ c++ cmake make; do command -v $t; done; "
                   "ls /var/cache/apt/archives/*.deb", check=False)
    assert not tools.stdout.strip(), tools.stdout  # what of them is there
    probe = ("import json, os, importlib.metadata as m; import horovod.torch as h, PIL; "
             "print(json.dumps({'uid': os.getuid(), 'gloo': h.gloo_built(), 'pil': PIL.__version__, "
             "'dists': {d.metadata['Name']: d.version for d in m.distributions()}}))")
    inside = json.loads(podman("run", "--rm", *ulimits().split(), IMAGE, "python", "-c", probe,
                               timeout=300).stdout)
    assert inside["uid"] == 10001 and inside["gloo"] and inside["pil"] == "12.1.1.post0", inside
    image_dists = {canonicalize_name(n): v for n, v in inside["dists"].items()}
    host = {canonicalize_name(d.metadata["Name"]): d.version for d in m.distributions()}
    differ = {n: (v, host.get(n)) for n, v in image_dists.items() if v != host.get(n)}
    assert not differ, f"the image's .venv and the host's differ (image, host): {differ}"
    runtime = requirement_names(["base", "ingest", "service", "trainer", "s3"])
    left_out = set(host) - set(image_dists)
    assert not left_out & runtime, left_out & runtime
    # what the dev extra alone brings (pytest, the linters, moto, selenium), unless a distribution in
    # the image needs it too (Horovod: psutil), is not there
    needed = {canonicalize_name(r.name) for n in image_dists
              for r in map(Requirement, m.distribution(n).requires or [])
              if not r.marker or r.marker.evaluate({"extra": ""})}
    assert requirement_names(["dev"]) - runtime - needed <= left_out, left_out


def test_the_pipeline_and_a_trainer_streaming_from_the_served_set(image, names, tmp_path):
    port = free_port()
    subs = {"kf-data": names["volume"], "kf-service": names["service"], "8765": str(port),
            "podman run ": f"podman run {ulimits()} ", "podman ": f"podman {podman_flags()} "}
    out = run_block("containers.md", "podman volume create kf-data", subs, cwd=tmp_path, timeout=900)
    assert re.search(r"\d+ shards? checked: 0 problems", out), out[-3000:]
    volume = Path(json.loads(podman("volume", "inspect", names["volume"]).stdout)[0]["Mountpoint"])
    manifest = json.loads((volume / "shards" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["num_samples"] == 32, manifest["splits"]["train"]
    local = [json.loads(line) for line in (volume / "runs" / "local"
                                           / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in local].count("epoch") == 1, local  # the one epoch asked for, trained
    assert (volume / "runs" / "local" / "checkpoint.pt").stat().st_size > 0
    assert (volume / "runs" / "local").stat().st_uid == 10001  # written by the image's user

    out = run_block("containers.md", "podman run -d --name kf-service", subs, cwd=tmp_path, timeout=900)
    served = [json.loads(line) for line in (volume / "runs" / "served"
                                            / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in served].count("epoch") == 1, served
    # the second container read the set over HTTP from the first: the service's access log
    shards_got = re.findall(r'"GET /v1/datasets/synth-motion/\S*train-\d+\.tar HTTP/1\.1" 20[06]', out)
    assert shards_got, out[-3000:]
    assert not podman("ps", "-a", "--filter", f"name={names['service']}", "--format",
                      "{{.Names}}").stdout.strip()
    run_block("containers.md", "podman volume rm kf-data", subs, cwd=tmp_path, timeout=120)
    assert podman("volume", "exists", names["volume"], check=False).returncode == 1
