"""The replicated service under faults (long stage): two ``shard-service serve`` replicas on one
PostgreSQL catalog behind nginx, which sends the bytes they hand it, all real and on loopback.

* A two-rank training run (``horovodrun -np 2 --gloo``) reads its set through nginx while the
  harness kills one replica with SIGKILL in epoch 1, restarts it in epoch 2 with PostgreSQL
  stopped, and starts PostgreSQL again three steps later; each fault is made while the job is
  held (SIGSTOP to every process of it at a step of rank 0's, SIGCONT once done), so each lands
  where it is meant to whatever the machine's load, and the job then reads on through it. The
  run ends well, every clip trained exactly once per epoch, the weights at every step and at the
  end bitwise equal to an undisturbed run's. Red without the retries (nginx's next upstream and
  the range client's, both off: the killed replica's requests end the run).
* A catalog commit, then PostgreSQL stopped before any replica looked a set up again: every
  replica, and nginx, answers the sets it knows 200 throughout the outage, a set the commit
  marked damaged included (``service.records``: a commit invalidates by generation, the last
  known record serves on within the staleness bound); each replica says so once, and once that
  the catalog is back; from then on the damaged set is refused. Red on caches that drop their
  answers at every commit (503 for every shard).
* An HTTP build survives the death of the replica running it: its build process is frozen, the
  replica killed; let go, the build process finds its server gone and leaves; the other replica
  takes the build over from its dead lease and finishes it, once (attempt 2), where the first left
  its work.
"""
from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from helpers import media
from helpers.fronts import accel_flags
from helpers.postgres import PostgresServer
from helpers.replica_runs import CLIPS, HeldRun, assert_trained_alike, replicated, train
from helpers.shardsets import http, make_shardset, register, wait_for

from shards.catalog import Catalog
from shards.format.manifest import Manifest

pytestmark = pytest.mark.long
TOKEN = "replica-fault-token"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ray_local):
    """Its own PostgreSQL (restarted by a test: no other test's connections to it), two replicas
    that may build (sources, a shared data root, the tests' Ray), nginx in front."""
    root = tmp_path_factory.mktemp("faults")
    videos = media.make_class_folders(root / "videos")
    (root / "tokens").write_text(TOKEN + "\n")
    make_shardset(str(root / "clips"), {"train": CLIPS}, per_shard=4, frames=4, size=(48, 40))
    db = PostgresServer()
    try:
        url = db.start().database()
        register(Catalog(url), str(root / "clips"), "clips")
        args = ("--catalog", url, "--token-file", str(root / "tokens"), "--source-root", str(videos),
                "--data-root",
                str(root / "sets"), "--ray-address", ray_local.get_runtime_context().gcs_address,
                *accel_flags(str(root)))
        with replicated(root, *args) as (replicas, front):
            yield {"root": root, "db": db, "url": url, "videos": videos, "replicas": replicas, "front": front}
    finally:
        db.close()


def test_training_reads_through_a_killed_replica_and_a_catalog_restart_bitwise(cluster, tmp_path):
    front, replicas, db = cluster["front"], cluster["replicas"], cluster["db"]
    data = f"{front.url}/v1/datasets/clips"
    shards = Manifest.load(str(cluster["root"] / "clips")).splits["train"].shards
    keys, shard = [k for s in shards for k in s.keys], shards[0].name

    calm = train(data, tmp_path / "calm")
    calm_log, _ = calm.communicate(timeout=600)
    assert calm.returncode == 0, calm_log[-3000:]

    served = [r.stats()["accel_redirects"] for r in replicas]
    run = HeldRun(data, tmp_path / "faults", [3, 7, 10])  # rank 0's steps
    postmaster = None
    try:
        run.held(3)
        assert all(r.stats()["accel_redirects"] > s for r, s in zip(replicas, served))  # both served it
        replicas[0].kill(signal.SIGKILL)  # epoch 1, step 3: the job reads on with one replica
        run.go_on(3)
        run.held(7)
        replicas[0].start()  # on its port: nginx uses it again past fail_timeout; a catalog write
        time.sleep(1)  # its notification reaches the other replica (milliseconds)
        postmaster = db.pid()
        db.stop()  # epoch 2, step 1: the job reads on with the catalog down
        status, _, body = http(replicas[1].url, path=f"/v1/datasets/clips/{shard}")
        assert status == 200, body  # a set it knows, after the write, with the catalog down
        run.go_on(7)
        run.held(10)
        db.start()  # epoch 2, step 4
        run.go_on(10)
        returncode = run.wait()
    finally:
        run.kill()
    assert db.pid() not in (None, postmaster)  # the catalog was restarted
    assert returncode == 0 and "Traceback" not in run.log, run.log[-4000:]
    assert_trained_alike(tmp_path / "calm", tmp_path / "faults", keys)
    assert "connect() failed" in front.errors()  # nginx met the dead replica, and asked the other


def test_an_http_build_survives_the_death_of_the_replica_running_it(cluster):
    front, replicas = cluster["front"], cluster["replicas"]
    body = json.dumps({"src": str(cluster["videos"]), "splits": ["train"], "short_side": 26,
                       "shard_samples": 2, "videos_per_task": 1, "workers": 1}).encode()
    status, _, answer = http(front.url, "POST", "/v1/builds", {"Authorization": f"Bearer {TOKEN}"}, body)
    assert status == 202, answer
    dataset = json.loads(answer)["id"]
    owner = Catalog(cluster["url"]).get(dataset).owner  # the lease: held by the build process once it started
    deadline = time.monotonic() + 120
    while not [r for r in replicas if any(f"build process {owner['pid']} started" in line for line in r.log)]:
        assert time.monotonic() < deadline, "no replica said it started the build"
        owner = Catalog(cluster["url"]).get(dataset).owner
        time.sleep(0.05)
    running = next(r for r in replicas if any(f"build process {owner['pid']} started" in line
                                              for line in r.log))
    other = next(r for r in replicas if r is not running)
    builder = psutil.Process(owner["pid"])
    os.killpg(builder.pid, signal.SIGSTOP)  # held: it cannot finish before its replica dies
    running.kill(signal.SIGKILL)
    os.killpg(builder.pid, signal.SIGCONT)  # it finds its server gone and leaves, recording nothing
    builder.wait(timeout=60)
    try:
        # a status request finds it orphaned: taken over
        done = wait_for(front.url, dataset, ("ready", "failed"))
        assert done["state"] == "ready" and done["attempts"] == 2, done
        assert any(f"build {dataset}: its builder (" in line and "taken over (attempt 2)" in line
                   for line in other.log)
        assert Manifest.load(done["location"]).splits["train"].num_samples == 4
        status, _, _ = http(front.url, path=f"/v1/datasets/{dataset}/manifest.json")
        assert status == 200
    finally:
        running.start()  # for any test after this one


def test_known_sets_are_read_through_a_catalog_outage_after_a_write_and_refused_once_it_says_so(
        cluster, tmp_path):
    front, replicas, db = cluster["front"], cluster["replicas"], cluster["db"]
    catalog = Catalog(cluster["url"])
    make_shardset(str(tmp_path / "doomed"), {"train": 4}, per_shard=2, frames=4, size=(48, 40))
    doomed = register(catalog, str(tmp_path / "doomed"), "doomed")
    shard = {ref: Manifest.load(where).splits["train"].shards[0].name
             for ref, where in (("clips", str(cluster["root"] / "clips")), (doomed.id, doomed.location))}
    reads = [(url, f"/v1/datasets/{ref}/{name}") for url in (*(r.url for r in replicas), front.url)
             for ref, name in shard.items()]

    def statuses() -> dict[tuple[str, str], int]:
        return {read: http(read[0], path=read[1])[0] for read in reads}

    assert set(statuses().values()) == {200}  # each replica has looked both sets up
    marks = [len(r.log) for r in replicas]
    # the write: every replica notified
    catalog.record_verify(doomed.id, 1, f"{shard[doomed.id]}: bytes differ")
    time.sleep(1)  # a notification takes milliseconds
    db.stop()
    try:
        rounds, deadline = 0, time.monotonic() + 3
        while time.monotonic() < deadline:
            answered = statuses()
            assert set(answered.values()) == {200}, answered
            rounds += 1
    finally:
        db.start()
    assert rounds >= 2
    deadline = time.monotonic() + 30  # the catalog is asked again once a replica's listener is back
    while {s for (_, path), s in statuses().items() if doomed.id in path} != {409}:
        assert time.monotonic() < deadline, statuses()
        time.sleep(0.1)
    assert {path: s for (_, path), s in statuses().items()} == {
        f"/v1/datasets/clips/{shard['clips']}": 200, f"/v1/datasets/{doomed.id}/{shard[doomed.id]}": 409}
    for replica, mark in zip(replicas, marks):
        lines = replica.log[mark:]
        assert sum("serving the sets this replica has looked up from their last known records" in line
                   for line in lines) == 1, lines
        assert sum("answers again after" in line for line in lines) == 1, lines
