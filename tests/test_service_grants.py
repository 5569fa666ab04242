"""Grants (``service.grants``) through a real nginx with the shipped configuration on loopback: a
replica decides once per file and client, nginx checks every request by itself (a tampered,
foreign or expired grant refused with no request reaching the replica), a set removed or found
damaged is refused from the next grant on, and the range client and the node cache keep and renew
grants without their callers noticing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse

import fsspec.config
import pytest
from helpers.fronts import Front, accel_flags, grant_flags
from helpers.required import require
from helpers.shardsets import ServiceProcess, http, make_shardset, register

import shards.io.http_range as http_range
from shards.catalog import Catalog
from shards.format.manifest import Manifest
from shards.read.cache import ShardCache
from shards.read.reading import open_range

NGINX = "/usr/sbin/nginx"
TOKEN = "grants-read-token"
SECONDS = 2  # the replica's --grant-seconds: short, so that the tests see grants expire
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    require("nginx", None if os.path.exists(NGINX) else f"{NGINX} missing: scripts/test.sh installs Debian's "
                                                        f"nginx-light")
    root = tmp_path_factory.mktemp("grants")
    cat = Catalog(str(root / "catalog.sqlite"))
    sets = {}
    for name in ("kept", "doomed", "spoilt"):
        make_shardset(str(root / name), {"train": 8}, per_shard=4)
        sets[name] = register(cat, str(root / name), name)
    (root / "tokens").write_text(TOKEN + "\n")
    links = str(root / "links")
    replica = ServiceProcess("--catalog", cat.path, "--read-auth", "--token-file", str(root / "tokens"),
                             *accel_flags(str(root)), *grant_flags(links, SECONDS))
    front = None
    try:
        replica.start()
        front = Front(root / "nginx", [replica.url.split("//")[1]], grant_links=links).start()
        yield {"root": root, "catalog": cat, "sets": sets, "replica": replica, "front": front}
    finally:
        if front is not None:
            front.stop()
        replica.kill(15)


@pytest.fixture
def client(monkeypatch):
    """This process's range client with the token and no grant kept from another test."""
    monkeypatch.setitem(fsspec.config.conf, "http", {"headers": AUTH})
    monkeypatch.setattr(http_range, "_GRANTS", http_range._Grants())
    return http_range._GRANTS


def counted(env) -> dict:
    """The replica's counters (this request counted in ``requests``)."""
    return json.loads(http(env["replica"].url, path="/v1/stats", headers=AUTH)[2])["total"]


def shard_of(env, name: str, k: int = 0):
    shard = Manifest.load(str(env["root"] / name)).splits["train"].shards[k]
    return shard, (env["root"] / name / shard.name).read_bytes()


def grant(env, name: str, shard, headers=AUTH) -> str:
    status, answer, _ = http(env["front"].url, path=f"/v1/datasets/{name}/{shard.name}", headers=headers)
    assert status == 307 and answer["cache-control"] == f"private, max-age={SECONDS - 1}", (status, answer)
    return answer["location"]


def expires(target: str) -> int:
    return int(urllib.parse.parse_qs(urllib.parse.urlsplit(target).query)["expires"][0])


def until_expired(target: str) -> None:
    """Wait for nginx's clock to pass the grant's expiry (a state, not a duration)."""
    while time.time() <= expires(target) + 1:
        time.sleep(0.2)


def test_a_shard_is_granted_once_and_every_range_sent_by_nginx(env, client, tmp_path):
    shard, data = shard_of(env, "kept")
    url = f"{env['front'].url}/v1/datasets/kept/{shard.name}"
    before = counted(env)
    spans = [(0, 100), (100, 5000), (7, shard.bytes), (shard.bytes - 10, shard.bytes)]
    for a, b in spans:
        assert open_range(url, a, b, size=shard.bytes, sha256=shard.sha256).read() == data[a:b]
    after = counted(env)
    target = client.get(url)
    assert target.startswith(f"{env['front'].url}/_grant/{env['sets']['kept'].id}/{shard.name}?expires=")
    # (a loaded machine may have outlasted the grant: then it was renewed)
    if time.time() < expires(target) - 1:
        assert after["grants"] - before["grants"] == 1 and after["requests"] - before["requests"] == 2
    assert (after["shard_bytes"] == before["shard_bytes"]
            and after["accel_redirects"] == before["accel_redirects"])
    assert str(env["root"]) not in target  # the set's id and the file's name, no server path
    # the node cache downloads through the same grants, verified
    copy = ShardCache(str(tmp_path / "cache")).fetch(url, shard.sha256, shard.bytes)
    assert open(copy, "rb").read() == data
    # a client that reaches the replica itself gets the bytes, never a grant nor a server path
    status, headers, body = http(env["replica"].url, path=f"/v1/datasets/kept/{shard.name}", headers=AUTH)
    assert status == 200 and body == data and "location" not in headers


def test_nginx_refuses_an_altered_foreign_or_expired_grant_without_asking_the_replica(env):
    shard, data = shard_of(env, "kept", 1)
    other, _ = shard_of(env, "kept", 0)
    target = grant(env, "kept", shard)
    path = target.split(env["front"].url, 1)[-1]
    front = env["front"].url
    before = counted(env)
    status, headers, body = http(front, path=path, headers={**AUTH, "Range": "bytes=10-1009"})
    assert (status == 206 and body == data[10:1010] and headers["content-range"] == f"bytes "
            f"10-1009/{shard.bytes}")
    uri, query = path.split("?")
    md5 = urllib.parse.parse_qs(query)["md5"][0]
    later = query.replace(f"expires={expires(target)}", f"expires={expires(target) + 3600}")
    altered = {"another signature": (f"{uri}?{query.replace(md5, ('A' if md5[0] != 'A' else 'B') + md5[1:])}",
                                     AUTH),
               "a later expiry": (f"{uri}?{later}", AUTH),
               "another file": (f"{uri.replace(shard.name, other.name)}?{query}", AUTH),
               "another token": (path, {"Authorization": "Bearer someone-else"}),
               "no token": (path, {}),
               "no signature": (uri, AUTH)}
    for what, (p, headers) in altered.items():
        status, _, body = http(front, path=p, headers=headers)
        assert status == 403 and data[:100] not in body, what
    until_expired(target)
    status, _, body = http(front, path=path, headers=AUTH)
    assert status == 410 and data[:100] not in body
    assert counted(env)["requests"] - before["requests"] == 1  # only this count: nginx answered all 8 alone


def test_the_range_client_renews_grants_across_their_expiry(env, client):
    shard, data = shard_of(env, "kept", 1)
    url = f"{env['front'].url}/v1/datasets/kept/{shard.name}"
    before = counted(env)["grants"]
    assert open_range(url, 0, 4000, size=shard.bytes, sha256=shard.sha256).read() == data[:4000]
    first = client.get(url)
    until_expired(first)  # past the kept grant's max-age: the client asks the replica for a new one
    assert client.get(url) is None
    assert open_range(url, 4000, 9000, size=shard.bytes, sha256=shard.sha256).read() == data[4000:9000]
    second = client.get(url)
    assert second != first and counted(env)["grants"] - before == 2
    # a grant the client still holds but nginx no longer honours (clocks apart): 410, then a new one
    until_expired(second)
    client.kept[url] = (second, time.monotonic() + 3600)
    assert open_range(url, 9000, shard.bytes, size=shard.bytes, sha256=shard.sha256).read() == data[9000:]
    assert client.get(url) not in (None, second) and counted(env)["grants"] - before == 3


def test_a_removed_or_damaged_set_is_refused_from_the_next_grant_on(env, client):
    def remove(rec):
        assert http(env["front"].url, "DELETE", f"/v1/datasets/{rec.id}", headers=AUTH)[0] == 200

    spoils = {"doomed": (remove, 404),
              "spoilt": (lambda rec: env["catalog"].record_verify(rec.id, 1, "a shard: SHA-256 differs"),
                         409)}
    reads, given = {}, []
    for name, (spoil, status) in spoils.items():
        shard, data = shard_of(env, name)
        reads[name] = (f"{env['front'].url}/v1/datasets/{name}/{shard.name}", shard, status)
        assert open_range(reads[name][0], 0, 1000, size=shard.bytes,
                          sha256=shard.sha256).read() == data[:1000]
        given.append(client.get(reads[name][0]))
        spoil(env["sets"][name])
        assert http(env["front"].url, path=f"/v1/datasets/{name}/{shard.name}",
                    headers=AUTH)[0] == status, name
    until_expired(max(given, key=expires))  # the grants given before: honoured until they expire (the bound)
    for name, (url, shard, status) in reads.items():
        with pytest.raises((FileNotFoundError, http_range.RangeError), match=str(status)):
            open_range(url, 0, 1000, size=shard.bytes, sha256=shard.sha256).read()


def test_grants_without_the_front_or_their_directory_are_refused_in_one_line(tmp_path):
    for flags in (["--grant-links", str(tmp_path)], [*accel_flags(str(tmp_path)), "--grant-links",
                                                     str(tmp_path / "no")]):
        out = subprocess.run([sys.executable, "-m", "service", "serve", "--catalog",
                              str(tmp_path / "c.sqlite"),
                              "--create", "--port", "0", *flags], capture_output=True, text=True, timeout=120)
        assert (out.returncode == 2 and out.stderr.count("\n") == 1
                and "--grant-links" in out.stderr), out.stderr
