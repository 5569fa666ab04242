"""The service runbook (docs/runbooks/service.md) run as written, on loopback: its blocks read from
the runbook and executed (tests/helpers/runbooks.py) with the substitutions below. ``shard-service serve``
behind a token file made as the runbook makes it, with ``--read-auth`` (readers without the token
refused, with it served); the listing; tag, verify and gc as the routine runs them; a backup of the
catalog taken while the server runs, then restored and served again; the replicated deployment on the
tests' PostgreSQL (its role and database, two replicas, nginx with the shipped configuration, one
replica killed). A set registered here stands
in for the runbook's cluster build (tests/test_cluster_ray.py builds and registers on two Ray
nodes); its trainers' block runs in tests/test_cluster_horovod.py.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers.runbooks import block_commands, ran, run_block, run_commands, shell_env
from helpers.shardsets import ServiceProcess, make_shardset, register

from shards.catalog import Catalog
from shards.format.manifest import Manifest

NAME = "k400-r256"


def subs(root: Path) -> dict[str, str]:
    """The service host's paths and address -> this test's; the backup's date fixed."""
    return {"/srv/kinetics-fast": f"{root}/srv", "/lustre/backup": f"{root}/backup", "10.0.0.5": "127.0.0.1",
            "--port 8765": "--port 0", "$(date -I)": "2026-01-31"}


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def serve(root: Path) -> ServiceProcess:
    """The runbook's ``shard-service serve`` line, started in the background."""
    line = block_commands("service.md", "python -c \"import secrets", subs(root))[1]
    server = ServiceProcess(command=tuple(shlex.split(line)), env=shell_env())
    server.start()
    ran(line)
    return server


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    """A registered set, and the server started behind a fresh token."""
    root = tmp_path_factory.mktemp("team")
    for d in ("srv", "backup"):
        (root / d).mkdir()
    catalog = str(root / "srv" / "catalog.sqlite")
    make_shardset(str(root / "sets" / NAME), {"train": 12, "val": 4}, per_shard=4)
    register(Catalog(catalog), str(root / "sets" / NAME), NAME)
    make_token = block_commands("service.md", "python -c \"import secrets", subs(root))[0]
    run_commands([make_token], cwd=root, env=shell_env())
    tokens = root / "srv" / "tokens"
    assert stat.S_IMODE(tokens.stat().st_mode) == 0o600
    state = {"root": root, "catalog": catalog, "token": tokens.read_text().strip(), "server": serve(root)}
    yield state
    state["server"].kill(15)  # the server running now: a test restarts it


def test_reads_need_the_token(team):
    listed = run_block("service.md", "ingest build --src /lustre/videos/k400", subs(team["root"]),
                       cwd=team["root"])
    assert NAME in listed and "ready" in listed, listed
    data = f"{team['server'].url}/v1/datasets/{NAME}"
    assert get(f"{team['server'].url}/v1/health")[0] == 200
    for path in ("", "/manifest.json", "/train/train-000000.tar"):
        assert get(data + path)[0] == 401 and get(data + path, "wrong")[0] == 403, path
    status, body = get(f"{data}/train/train-000000.tar", team["token"])
    assert (status == 200 and body == (team["root"] / "sets" / NAME / "train"
                                       / "train-000000.tar").read_bytes())


def test_tag_verify_gc_and_a_backup_restored_while_serving(team):
    catalog, root = team["catalog"], team["root"]
    # a build that died, with files left behind: what gc is for
    cat = Catalog(catalog)
    dead = cat.claim("dd" * 32, source=str(root / "videos"), location=str(root / "sets" / "dead"), options={},
                     name="dead-build")
    (root / "sets" / "dead" / ".staging").mkdir(parents=True)
    (root / "sets" / "dead" / ".staging" / "batch-0.jsonl").write_text("{}\n")
    cat.fail(dead.record.id, dead.owner, "killed")

    tag_cmd, verify_cmd, gc_cmd, gc_yes_cmd = block_commands("service.md", "shard-service tag", subs(root))
    assert "tagged" in run_commands([tag_cmd], cwd=root, env=shell_env())
    assert ": 0 problems" in run_commands([verify_cmd], cwd=root, env=shell_env())
    out = run_commands([gc_cmd], cwd=root, env=shell_env())
    assert f"would remove {dead.record.id}" in out and "dry run" in out
    assert (root / "sets" / "dead").exists()
    out = run_commands([gc_yes_cmd], cwd=root, env=shell_env())
    assert f"removed {dead.record.id}" in out and NAME not in out
    assert not (root / "sets" / "dead").exists() and (root / "sets" / NAME / "manifest.json").exists()

    listed = run_block("service.md", "python -c \"import sqlite3", subs(root), cwd=root)  # the backup, listed
    assert (root / "backup" / "catalog-2026-01-31.sqlite").stat().st_size > 0
    assert NAME in listed and "[paper-v1]" in listed and "dead-build" not in listed, listed

    # restore: stop the server, the backup over the catalog, the old database's -wal and -shm gone
    team["server"].kill(15)
    run_block("service.md", "cp /lustre/backup/catalog-2026-01-31.sqlite", subs(root), cwd=root)
    assert not any(os.path.exists(catalog + suffix) for suffix in ("-wal", "-shm"))
    team["server"] = server = serve(root)
    status, body = get(f"{server.url}/v1/datasets/paper-v1", team["token"])
    assert (status == 200 and json.loads(body)["name"] == NAME
            and json.loads(body)["verified"]["problems"] == 0)
    status, body = get(f"{server.url}/v1/datasets/paper-v1/manifest.json", team["token"])
    assert status == 200 and Manifest.from_json(body).splits["train"].num_samples == 12
    assert get(f"{server.url}/v1/datasets/paper-v1/manifest.json")[0] == 401  # still behind the token


def test_replicas_on_postgresql_behind_nginx(team, postgres):
    """The runbook's replicated deployment: the role and database made with its commands on the
    tests' PostgreSQL, two replicas started with its ``serve`` line (ports of their own), nginx with
    the shipped configuration listing them, the set read through nginx with the token (its bytes
    sent by nginx), still read with one replica killed, and listed from the catalog's URL."""
    from helpers.fronts import ACCEL_SECRET, free_port, front_config, write_secret

    root, role, db = team["root"], f"kf{os.getpid()}", f"kinetics_fast_{os.getpid()}"
    url = f"postgresql://{role}@127.0.0.1:{postgres.port}/{db}"
    pg = {"postgresql://kf@db.internal/kinetics_fast": url,
          "--owner kf kinetics_fast": f"--owner {role} {db}",
          "--host db.internal --username postgres": f"--host 127.0.0.1 --port {postgres.port} --username "
                                                    f"{postgres.user}",
          f"{postgres.user} kf": f"{postgres.user} {role}", "/lustre/sets/service": f"{root}/sets-service",
          "/lustre/videos": f"{root}/videos", "/lustre/sets/grants": f"{root}/grants", **subs(root)}
    (root / "videos").mkdir(exist_ok=True)
    (root / "grants").mkdir(exist_ok=True)  # the runbook's mkdir, once
    run_block("service.md", "createuser --host db.internal", pg, cwd=root)
    register(Catalog(url), str(root / "sets" / NAME), NAME)
    ports, replicas, front = [free_port(), free_port()], [], None
    # the runbook's secret, on each replica host
    (root / "srv" / "accel-secret").write_text(ACCEL_SECRET + "\n")
    try:
        for port in ports:
            (line,) = block_commands("service.md", "shard-service serve --catalog postgresql://",
                                     {**pg, "--port 0": f"--port {port}"})
            replicas.append(ServiceProcess(command=tuple(shlex.split(line)), env=shell_env()))
            replicas[-1].start()
            ran(line)
        conf, front_port = root / "front" / "nginx.conf", free_port()
        conf.parent.mkdir(exist_ok=True)
        conf.write_text(front_config(str(conf.parent), front_port, [f"127.0.0.1:{p}" for p in ports],
                                     str(root / "grants")))
        write_secret(str(conf.parent))  # ... and beside nginx's configuration
        nginx_line, list_line = block_commands("service.md", "nginx -c "
                                               "/opt/kinetics-fast/docker/nginx-replicas.conf",
                                               {"/opt/kinetics-fast/docker/nginx-replicas.conf": str(conf),
                                                **pg})
        # in the foreground: stopped by its pid
        front = ServiceProcess(command=tuple(shlex.split(nginx_line)))
        front.proc = subprocess.Popen(front.command, start_new_session=True)
        data = f"http://127.0.0.1:{front_port}/v1/datasets/{NAME}/train/train-000000.tar"
        shard = (root / "sets" / NAME / "train" / "train-000000.tar").read_bytes()
        deadline = time.monotonic() + 60
        while (got := get_or_none(data, team["token"])) is None:
            assert front.proc.poll() is None and time.monotonic() < deadline, "nginx never answered"
            time.sleep(0.05)
        assert got == (200, shard) and get(data)[0] == 401
        ran(nginx_line)
        for _ in range(4):  # both replicas answered (nginx balances); nginx sent the bytes they granted
            assert get(data, team["token"]) == (200, shard)
        replicas[0].kill(9)
        assert all(get(data, team["token"]) == (200, shard) for _ in range(4))  # the other one answers
        granted = json.loads(get(f"{replicas[1].url}/v1/stats", team["token"])[1])["total"]["grants"]
        assert granted >= 3  # (urllib keeps no grant: each GET asked for one)
        listed = run_commands([list_line], cwd=root, env=shell_env())
        assert NAME in listed and "ready" in listed, listed
    finally:
        if front is not None and front.proc.poll() is None:
            os.killpg(front.proc.pid, signal.SIGQUIT)
            front.proc.wait(timeout=60)
        for r in replicas:
            r.kill(15)


def get_or_none(url: str, token: str) -> tuple[int, bytes] | None:
    """``get``, or None while nothing listens yet."""
    try:
        return get(url, token)
    except urllib.error.URLError as e:
        if isinstance(e, urllib.error.HTTPError):
            raise
        return None
