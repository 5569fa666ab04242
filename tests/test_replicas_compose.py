"""The replica command line of docker/compose-replicas.yaml, run as written on loopback (long
stage): not in a container, its script read out of the YAML and given only this machine's places
(the catalog's URL, the address and port, the token file, ``/data``), so that what the compose file
says is what runs. It builds a set over HTTP with an embedded Ray of its own, as a replica of the
compose file does (whose build processes inherit its umask), and that set must be readable by
nginx's workers, a user other than the replica's: every file world-readable, every directory
world-searchable (red under the ``umask 077`` the file once ran the replica with: 0600 files in
0700 directories, 403 from nginx). The token file stays the replica's own (0600). Every
connection from nginx comes from one address, so the replica must take more connections from one
client than the default per-client cap (256): 300 held open, and a request still answered.
"""
from __future__ import annotations

import json
import os
import socket
import stat
import sys
from pathlib import Path

import pytest
import yaml
from helpers import media
from helpers.shardsets import ServiceProcess, http, wait_for

pytestmark = pytest.mark.long
COMPOSE = Path(__file__).resolve().parents[1] / "docker" / "compose-replicas.yaml"
TOKEN = "compose-replica-token"
HELD = 300  # connections from one client, over serve's default --max-connections-per-client (256)


def replica_script(catalog: str, root: Path) -> list[str]:
    """The compose file's replica command (``bash -ec SCRIPT``), with this machine's places in it."""
    command = yaml.safe_load(COMPOSE.read_text())["x-replica"]["command"]
    assert command[:2] == ["bash", "-ec"], command
    script = command[2].replace("$$", "$")  # compose's escape of a literal $
    for theirs, ours in (("postgresql://kf@postgres:5432/kinetics_fast", catalog),
                         ("--host 0.0.0.0", "--host 127.0.0.1"),
                         ("--port 8765", "--port 0"), ("/tmp/tokens", str(root / "tokens")),
                         ("/tmp/accel-secret", str(root / "accel-secret")), (" /data/", f" {root}/data/")):
        assert theirs in script, f"{COMPOSE}: the replica command no longer has {theirs!r}"
        script = script.replace(theirs, ours)
    return [*command[:2], script]


def unreadable_by_others(top: Path) -> list[str]:
    """What under ``top`` (itself included) a user other than its owner cannot read or search."""
    found = []
    for where, dirs, files in os.walk(top):
        for path in [Path(where), *(Path(where) / f for f in files)]:
            mode = path.stat().st_mode
            need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
            if mode & need != need:
                found.append(f"{path} {stat.filemode(mode)}")
    return sorted(set(found))


def test_the_compose_replica_builds_sets_nginx_can_read_and_takes_many_connections_from_one_client(postgres,
                                                                                                    tmp_path):
    media.make_class_folders(tmp_path / "data" / "videos")
    env = {**os.environ, "KF_TOKEN": TOKEN, "KF_ACCEL_SECRET": "s" * 32,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    replica = ServiceProcess(env=env, command=tuple(replica_script(postgres.database(), tmp_path)))
    held = []
    try:
        url = replica.start()
        for secret in ("tokens", "accel-secret"):  # the secrets stay the replica's
            assert stat.S_IMODE((tmp_path / secret).stat().st_mode) == 0o600, secret
        body = json.dumps({"src": str(tmp_path / "data" / "videos"), "splits": ["train"], "short_side": 26,
                           "shard_samples": 2, "videos_per_task": 1, "workers": 1}).encode()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status, _, answer = http(url, "POST", "/v1/builds", auth, body)
        assert status == 202, answer
        done = wait_for(url, json.loads(answer)["id"], ("ready", "failed"), headers=auth)
        assert done["state"] == "ready", done
        assert Path(done["location"]).is_relative_to(tmp_path / "data" / "sets")
        assert unreadable_by_others(tmp_path / "data" / "sets") == []
        host, port = url.split("//")[1].split(":")
        held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(HELD)]
        status, _, answer = http(url, path="/v1/health")
        assert status == 200, answer
    finally:
        for conn in held:
            conn.close()
        replica.kill(15)
