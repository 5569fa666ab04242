"""Builds asked for over HTTP, each run in a build process of its own, on a real ``shard-service
serve`` with real Ray and ffmpeg: the server outlives its builds (it serves and builds again past
the 60 s after which Ray, started by a finished build thread, used to take the server down), a
build process that is killed or stopped is recorded failed with its reason at once and leaves no
process behind, a Ray that cannot be joined fails the build at once with the reason, and
different builds posted together all finish (queued for one slot, or sharing a Ray cluster)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from helpers import media
from helpers.shardsets import ServiceProcess, http, wait_for

from shards.catalog import Catalog
from shards.format.manifest import Manifest

TOKEN = "token-for-build-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return media.make_class_folders(tmp_path_factory.mktemp("videos"))


def serve(root, *args: str) -> ServiceProcess:
    (root / "tokens").write_text(TOKEN + "\n")
    server = ServiceProcess("--catalog", str(root / "catalog.sqlite"), "--create", "--token-file",
                            str(root / "tokens"), "--data-root", str(root / "sets"), *args)
    server.start()
    return server


def post(url: str, videos, **options) -> tuple[int, dict]:
    status, _, answer = http(url, "POST", "/v1/builds", AUTH,
                             json.dumps({"src": str(videos), **options}).encode())
    return status, json.loads(answer)


def no_children(server: ServiceProcess) -> None:
    """Wait until the server has no child process left (a finished build's process and its Ray)."""
    gone, alive = psutil.wait_procs(psutil.Process(server.proc.pid).children(recursive=True), timeout=60)
    assert not alive, alive


@pytest.mark.long  # a minute's wait for Ray's driver timeout: only a long run shows it
def test_the_server_outlives_its_builds_and_builds_again_minutes_later(tmp_path, videos):
    # no --ray-address: each build starts an embedded Ray
    server = serve(tmp_path, "--source-root", str(videos))
    try:
        status, first = post(server.url, videos, splits=["val"], short_side=30, shard_samples=2)
        assert status == 202
        assert wait_for(server.url, first["id"], ("ready", "failed"))["state"] == "ready"
        time.sleep(65)  # past the 60 s in which a Ray driver notices its Ray is gone and ends its process
        assert server.proc.poll() is None and http(server.url, path="/v1/health")[0] == 200
        no_children(server)  # the build's process and its Ray ended with the build
        # two more builds, different, posted together: they queue for the one build slot, both finish
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda side: post(server.url, videos, splits=["train"], short_side=side,
                                                      shard_samples=2), (24, 26)))
        assert [status for status, _ in answers] == [202, 202]
        for _, answer in answers:
            done = wait_for(server.url, answer["id"], ("ready", "failed"))
            assert done["state"] == "ready" and done["attempts"] == 1, done
            status, _, manifest = http(server.url, path=f"/v1/datasets/{answer['id']}/manifest.json")
            assert status == 200 and Manifest.from_json(manifest).splits["train"].num_samples == 4
        assert server.proc.poll() is None
    finally:
        server.kill(signal.SIGTERM)
    assert server.proc.returncode == 0


def test_a_killed_build_process_is_recorded_failed_at_once_and_asking_again_resumes(
        tmp_path, videos, ray_local):
    server = serve(tmp_path, "--source-root", str(videos), "--ray-address",
                   ray_local.get_runtime_context().gcs_address)
    try:
        for side in (22, 23, 25):  # a build of seconds may end before its process is found: then another
            status, answer = post(server.url, videos, splits=["train"], short_side=side, shard_samples=2)
            assert status == 202
            builder = server.build_process(dataset=answer["id"])
            with contextlib.suppress(ProcessLookupError):  # (gone: its build is over)
                # held where it is, so that what is killed is a running build
                os.killpg(builder.pid, signal.SIGSTOP)
                # the catalog, not the server's view: a build records its outcome there as its last act
                if Catalog(str(tmp_path
                               / "catalog.sqlite")).get(answer["id"]).state not in ("ready", "failed"):
                    break
                os.killpg(builder.pid, signal.SIGCONT)
            no_children(server)
        os.killpg(builder.pid, signal.SIGKILL)  # as the kernel's OOM killer would
        failed = wait_for(server.url, answer["id"], ("ready", "failed"))
        assert failed["state"] == "failed" and "was killed by SIGKILL" in failed["error"], failed
        no_children(server)
        status, again = post(server.url, videos, splits=["train"], short_side=side, shard_samples=2)
        assert status == 202 and again["id"] == answer["id"]
        done = wait_for(server.url, answer["id"], ("ready", "failed"))
        assert done["state"] == "ready" and done["attempts"] == 2, done
    finally:
        server.kill(signal.SIGTERM)


def test_sigterm_stops_the_running_build_records_it_and_leaves_no_process(tmp_path, videos):
    server = serve(tmp_path, "--source-root", str(videos))
    started = []
    try:
        status, answer = post(server.url, videos, splits=["train"], short_side=20, shard_samples=2)
        assert status == 202
        builder = server.build_process()
        os.killpg(builder.pid, signal.SIGSTOP)  # held where it is: a build of seconds cannot finish under us
        started = [builder, *builder.children(recursive=True)]
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 60
        while not any("stopping build process" in line for line in server.log):
            assert time.time() < deadline and server.proc.poll() is None, "".join(server.log)
            time.sleep(0.05)
        try:
            os.killpg(builder.pid, signal.SIGCONT)  # now it handles the server's SIGTERM ...
        except ProcessLookupError:
            # ... unless caught before it had a handler: SIGTERM's default action ends even a stopped process
            pass
        assert server.proc.wait(timeout=120) == 0
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert not alive and not [p for p in psutil.process_iter(["pid"]) if _group(p) == builder.pid]
    finally:  # on a failure above: the stopped build and the server stopped here, not left to the session
        for p in started:
            with contextlib.suppress(psutil.Error):
                p.kill()
        server.kill(signal.SIGKILL)
    rec = Catalog(str(tmp_path / "catalog.sqlite")).get(answer["id"])
    assert rec.state == "failed" and rec.error.lower().startswith("stopped"), rec.error


def _group(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except ProcessLookupError:
        return None


def test_a_ray_that_cannot_be_joined_fails_the_build_at_once_with_the_reason(tmp_path, videos):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve(tmp_path, "--source-root", str(videos), "--ray-address", f"127.0.0.1:{port}")
    try:
        status, answer = post(server.url, videos, splits=["val"], short_side=30, shard_samples=2)
        assert status == 202
        failed = wait_for(server.url, answer["id"], ("ready", "failed"), timeout=60)
        assert failed["state"] == "failed", failed
        expected = (f"could not join the Ray cluster at 127.0.0.1:{port}: "
                    f"ConnectionError: nothing answers at 127.0.0.1:{port}")
        assert failed["error"].startswith(expected), failed["error"]
        assert http(server.url, path="/v1/health")[0] == 200
    finally:
        server.kill(signal.SIGTERM)


def test_different_builds_posted_together_share_a_ray_cluster(tmp_path, videos, ray_local):
    server = serve(tmp_path, "--source-root", str(videos), "--ray-address",
                   ray_local.get_runtime_context().gcs_address, "--max-builds", "2")
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda seed: post(server.url, videos, splits=["val"], short_side=30,
                                                      seed=seed, shard_samples=2), (1, 2)))
        assert [status for status, _ in answers] == [202, 202] and answers[0][1]["id"] != answers[1][1]["id"]
        for _, answer in answers:
            done = wait_for(server.url, answer["id"], ("ready", "failed"))
            assert done["state"] == "ready", done
    finally:
        server.kill(signal.SIGTERM)


def test_a_server_started_without_source_roots_refuses_every_build(tmp_path, videos):
    server = serve(tmp_path)
    try:
        status, _, answer = http(server.url, "POST", "/v1/builds", AUTH,
                                 json.dumps({"src": str(videos)}).encode())
        assert status == 403 and json.loads(answer)["error"] == ("builds over HTTP are disabled: the server "
                                                                 "was started without --source-root")
    finally:
        server.kill(signal.SIGTERM)
