"""The service runbook (docs/runbooks/service.md) for real, on loopback: ``shard-service serve``
behind a token file made as the runbook makes it, with ``--read-auth`` (readers without the token
refused, with it served); tag, verify and gc as the routine runs them; a backup of the catalog
taken while the server runs, then restored and served again. The runbook's build registration
runs in tests/test_cluster_ray.py and its trainers (token in fsspec's headers, node-local cache
within ``SHARD_CACHE_BUDGET``) in tests/test_cluster_horovod.py.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from shardsets import ServiceProcess, make_shardset, register

from service.cli import main as shard_service_main
from shards.catalog import Catalog
from shards.manifest import Manifest

SHARD_SERVICE = str(Path(sys.executable).parent / "shard-service")
NAME = "team-set"


def shard_service(*argv: str) -> tuple[int, str]:
    """``shard-service ...`` through the console script's own main, in this process; (exit code, stdout)."""
    assert argv[0] == "shard-service"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = shard_service_main(list(argv[1:]))
    return code, out.getvalue()


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def serve(catalog: str, tokens: str) -> ServiceProcess:
    server = ServiceProcess("--catalog", catalog, "--token-file", tokens, "--read-auth",
                            command=(SHARD_SERVICE, "serve", "--host", "127.0.0.1", "--port", "0"))
    server.start()
    return server


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    """A registered set, and the server started behind a fresh token."""
    root = tmp_path_factory.mktemp("team")
    catalog = str(root / "catalog.sqlite")
    make_shardset(str(root / "sets" / NAME), {"train": 12, "val": 4}, per_shard=4)
    register(Catalog(catalog), str(root / "sets" / NAME), NAME)
    token = subprocess.run([sys.executable, "-c", "import secrets; print(secrets.token_urlsafe(32))"],
                           capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    tokens = root / "tokens"
    tokens.write_text(token + "\n")
    os.chmod(tokens, 0o600)  # chmod 600, as the runbook says
    server = serve(catalog, str(tokens))
    yield {"root": root, "catalog": catalog, "tokens": str(tokens), "token": token, "server": server}
    server.kill(15)


def test_reads_need_the_token(team):
    code, listed = shard_service("shard-service", "list", "--catalog", team["catalog"])
    assert code == 0 and NAME in listed and "ready" in listed, listed
    data = f"{team['server'].url}/v1/datasets/{NAME}"
    assert get(f"{team['server'].url}/v1/health")[0] == 200
    for path in ("", "/manifest.json", "/train/train-000000.tar"):
        assert get(data + path)[0] == 401 and get(data + path, "wrong")[0] == 403, path
    status, body = get(f"{data}/train/train-000000.tar", team["token"])
    assert status == 200 and body == (team["root"] / "sets" / NAME / "train" / "train-000000.tar").read_bytes()


def test_tag_verify_gc_and_a_backup_restored_while_serving(team):
    catalog, root = team["catalog"], team["root"]
    # a build that died, with files left behind: what gc is for
    cat = Catalog(catalog)
    dead = cat.claim("dd" * 32, source=str(root / "videos"), location=str(root / "sets" / "dead"), options={},
                     name="dead-build")
    (root / "sets" / "dead" / ".staging").mkdir(parents=True)
    (root / "sets" / "dead" / ".staging" / "batch-0.jsonl").write_text("{}\n")
    cat.fail(dead.record.id, dead.owner, "killed")

    code, out = shard_service("shard-service", "tag", "--catalog", catalog, NAME, "paper-v1")
    assert code == 0 and "tagged" in out
    code, out = shard_service("shard-service", "verify", "--catalog", catalog, "paper-v1")
    assert code == 0 and ": 0 problems" in out, out
    code, out = shard_service("shard-service", "gc", "--catalog", catalog)
    assert code == 0 and f"would remove {dead.record.id}" in out and "dry run" in out
    assert (root / "sets" / "dead").exists()
    code, out = shard_service("shard-service", "gc", "--catalog", catalog, "--yes")
    assert code == 0 and f"removed {dead.record.id}" in out and NAME not in out
    assert not (root / "sets" / "dead").exists() and (root / "sets" / NAME / "manifest.json").exists()

    backup = root / "backup" / "catalog-today.sqlite"
    backup.parent.mkdir()
    subprocess.run([sys.executable, "-c", "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup("
                    "sqlite3.connect(sys.argv[2]))", catalog, str(backup)], check=True, timeout=60)
    code, listed = shard_service("shard-service", "list", "--catalog", str(backup))
    assert code == 0 and NAME in listed and "[paper-v1]" in listed and "dead-build" not in listed, listed

    # restore: stop the server, the backup over the catalog, the old database's -wal and -shm gone
    team["server"].kill(15)
    shutil.copy(backup, catalog)  # cp
    for suffix in ("-wal", "-shm"):
        Path(catalog + suffix).unlink(missing_ok=True)  # rm -f
    team["server"] = server = serve(catalog, team["tokens"])
    status, body = get(f"{server.url}/v1/datasets/paper-v1", team["token"])
    assert status == 200 and json.loads(body)["name"] == NAME and json.loads(body)["verified"]["problems"] == 0
    status, body = get(f"{server.url}/v1/datasets/paper-v1/manifest.json", team["token"])
    assert status == 200 and Manifest.from_json(body).splits["train"].num_samples == 12
    assert get(f"{server.url}/v1/datasets/paper-v1/manifest.json")[0] == 401  # still behind the token
