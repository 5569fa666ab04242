"""Replicas of the service on one PostgreSQL catalog behind nginx, each really started: two
``shard-service serve`` processes (different ports, nothing shared but the catalog and the sets),
nginx balancing them and sending the bytes they hand it. A change made through one replica
(a tag moved, a set found damaged, a set removed) is seen by the other, whose caches held the old
answer; a replica killed between requests costs a client nothing (nginx's next upstream), and a
killed replica restarted on its port is used again; an orphaned build a replica must not run
again is recorded failed saying why. The long stage's fault proof is in
tests/test_replicas_faults.py."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import media
from helpers.fronts import Front, accel_flags, free_port
from helpers.shardsets import ServiceProcess, http, make_shardset, register

from ingest import registry
from service.builds import MAX_ATTEMPTS, Builds, parse_body
from service.roots import SourceRoots
from shards.catalog import Catalog
from shards.format.manifest import Manifest

TOKEN = "replica-writer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Replica(ServiceProcess):
    """A replica on a port of its own, so that restarted it is where nginx looks for it."""

    def __init__(self, catalog: str, tokens: str):
        self.port = free_port()
        super().__init__("--catalog", catalog, "--token-file", tokens, *accel_flags(os.path.dirname(tokens)),
                         "--port", str(self.port), "--max-connections-per-client", "0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, postgres):
    root = tmp_path_factory.mktemp("replicas")
    url = postgres.database()
    cat = Catalog(url)
    sets = {}
    for name, clips in (("alpha", 8), ("beta", 12), ("gamma", 8)):
        make_shardset(str(root / name), {"train": clips}, per_shard=4)
        sets[name] = register(cat, str(root / name), name)
    cat.tag(sets["alpha"].id, "prod")
    (root / "tokens").write_text(TOKEN + "\n")
    replicas = [Replica(url, str(root / "tokens")) for _ in range(2)]
    front = Front(root / "nginx", [r.address for r in replicas])
    try:
        for r in replicas:
            r.start()
        front.start()
        yield {"root": root, "catalog": cat, "sets": sets, "replicas": replicas, "front": front}
    finally:
        front.stop()
        for r in replicas:
            r.kill(signal.SIGTERM)


def manifest_of(url: str, ref: str) -> bytes:
    status, _, body = http(url, path=f"/v1/datasets/{ref}/manifest.json")
    assert status == 200, body[:300]
    return body


def until(condition, what: str, seconds: float = 30) -> None:
    """Wait for a state (a notification that must arrive), failing naming it if it never does."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def test_a_change_through_one_replica_is_seen_by_the_other(cluster):
    a, b = (r.url for r in cluster["replicas"])
    alpha, beta, gamma = (cluster["sets"][n] for n in ("alpha", "beta", "gamma"))
    alpha_manifest, beta_manifest = (manifest_of(a, s.id) for s in (alpha, beta))
    assert manifest_of(b, "prod") == alpha_manifest  # b has looked it up: its caches hold prod -> alpha
    shard = Manifest.load(gamma.location).splits["train"].shards[0].name
    assert http(b, path=f"/v1/datasets/{gamma.id}/{shard}")[0] == 200  # and gamma's file table
    status, _, _ = http(a, "PUT", f"/v1/datasets/{beta.id}/tags/prod", AUTH)  # moved through a
    assert status == 200
    until(lambda: manifest_of(b, "prod") == beta_manifest, "replica b seeing prod moved to beta")
    # as `shard-service verify`
    Catalog(cluster["catalog"].path).record_verify(gamma.id, 1, f"{shard}: bytes differ")
    until(lambda: http(b, path=f"/v1/datasets/{gamma.id}/{shard}")[0] == 409,
          "replica b refusing damaged gamma")
    status, _, body = http(b, path=f"/v1/datasets/{gamma.id}/{shard}")
    assert "is damaged" in json.loads(body)["error"]
    status, _, _ = http(a, "DELETE", f"/v1/datasets/{gamma.id}", AUTH)  # forgotten through a
    assert status == 200
    until(lambda: http(b, path=f"/v1/datasets/{gamma.id}/{shard}")[0] == 404, "replica b forgetting gamma")


def test_reads_through_nginx_ride_through_a_killed_replica_and_use_it_again_restarted(cluster):
    front, replicas, alpha = cluster["front"], cluster["replicas"], cluster["sets"]["alpha"]
    shards = Manifest.load(alpha.location).splits["train"].shards
    files = {s.name: (cluster["root"] / "alpha" / s.name).read_bytes() for s in shards}

    def reads(n: int) -> list[int]:
        statuses = []
        for i in range(n):
            name = shards[i % len(shards)].name
            status, headers, body = http(front.url, path=f"/v1/datasets/{alpha.id}/{name}",
                                         headers={"Range": f"bytes={i}-{i + 999}"})
            assert (body == files[name][i:i + 1000]
                    and headers["etag"] == f'"{shards[i % len(shards)].sha256}"')
            statuses.append(status)
        return statuses

    def served() -> list[int]:
        return [json.loads(http(r.url, path="/v1/stats")[2])["total"]["accel_redirects"]
                if r.proc.poll() is None else -1 for r in replicas]

    before = served()
    assert reads(20) == [206] * 20
    middle = served()
    assert all(m > b for m, b in zip(middle, before)), (before, middle)  # both replicas answered
    replicas[0].kill(signal.SIGKILL)
    assert reads(20) == [206] * 20  # nginx found it refusing and asked the other
    after = served()
    assert after[1] - middle[1] == 20
    replicas[0].start()  # on its port: nginx uses it again once its fail_timeout has passed
    until(lambda: reads(4) and served()[0] > 0, "nginx using the restarted replica again")
    assert "no live upstreams" not in front.errors()


def test_an_orphan_is_taken_over_only_while_it_can_be(catalog_location, tmp_path):
    """``Builds.take_over`` (what each replica runs every 15 s) on orphans it must not build: one
    whose builders died five times (the build itself may be what kills them), one whose sources
    changed since it was asked for; both recorded failed saying why, neither built. A server
    without --source-root leaves orphans alone."""
    videos = media.make_class_folders(tmp_path / "videos")
    cat = Catalog(catalog_location)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True)
    owner = {"host": socket.gethostname(), "pid": int(dead.stdout), "token": "gone"}
    request = {"src": str(videos), "splits": ["val"], "short_side": 30, "shard_samples": 2}
    req = parse_body(request, 1)
    plan = registry.plan(str(videos), req["cfg"], shard_size=req["shard_size"],
                         shard_samples=req["shard_samples"],
                         splits=req["splits"])  # the id a replica plans this request to: it would build it
    for _ in range(MAX_ATTEMPTS):  # each builder dies: the next claim finds its lease dead
        tired = cat.claim(plan.id, source=str(videos), location=str(tmp_path / "tired"), options={},
                          owner=owner, request=request)
    assert tired.record.attempts == MAX_ATTEMPTS
    changed = cat.claim("a2" * 32, source=str(videos), location=str(tmp_path / "changed"), options={},
                        owner=owner,
                        request=request)  # an id no plan of this request makes: its sources "changed"
    assert {r.id for r in cat.orphans()} == {tired.record.id, changed.record.id}

    async def take_over(roots):
        return await Builds(cat, str(tmp_path / "sets"), None, roots=roots, max_workers=1).take_over()

    assert asyncio.run(take_over(SourceRoots([]))) == [] and len(cat.orphans()) == 2  # left to builders
    assert asyncio.run(take_over(SourceRoots([str(videos)]))) == []
    tired, changed = cat.get(tired.record.id), cat.get(changed.record.id)
    assert tired.state == "failed" and f"after {MAX_ATTEMPTS} attempts; not taken over again" in tired.error
    assert changed.state == "failed" and "its sources changed since it was asked for" in changed.error
    assert cat.orphans() == [] and not (tmp_path / "tired").exists() and not (tmp_path / "changed").exists()


def test_the_start_lines_name_a_postgresql_catalog_without_its_password(postgres):
    """Before: ``serving ... (catalog postgresql://kf:PASSWORD@...)`` in the service's journal. The
    tests' server trusts loopback, so the password in the URL is ignored and the server starts."""
    user, rest = postgres.database().removeprefix("postgresql://").split("@", 1)
    server = ServiceProcess("--catalog", f"postgresql://{user}:never-print-me@{rest}")
    try:
        server.start()
        assert ("never-print-me" not in "".join(server.banner)
                and f"catalog postgresql://{user}:***@{rest}\n" in server.banner[1]), server.banner
        assert http(server.url, path="/v1")[0] == 200
    finally:
        server.kill()
