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
* The staleness bound itself, on a ``RecordCache`` of a 1 s bound: past it, and for a reference
  never looked up, an outage is ``CatalogUnavailable`` (503).
* An HTTP build survives the death of the replica running it: its build process is frozen, the
  replica killed; let go, the build process finds its server gone and leaves; the other replica
  takes the build over from its dead lease and finishes it, once (attempt 2), where the first left
  its work.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch
from helpers import media
from helpers.fronts import Front, accel_flags, free_port
from helpers.postgres import PostgresServer
from helpers.shardsets import ServiceProcess, http, make_shardset, register, wait_for

from service.records import RecordCache
from shards.catalog import Catalog, CatalogUnavailable
from shards.format.manifest import Manifest
from trainer.clip_log import read_file

pytestmark = pytest.mark.long
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
FAULTRUN = str(Path(__file__).with_name("helpers") / "faultrun.py")
CLIPS, BATCH, EPOCHS = 24, 2, 2
FLAGS = ["--segments", "4", "--depth", "10", "--width", "8", "--crop-size", "32", "--scale-size", "36",
         "--batch-size", str(BATCH), "--warmup-epochs", "0.5", "--workers", "1", "--print-freq", "1",
         "--no-tensorboard", "--clip-log", "--epochs", str(EPOCHS), "--val-split", ""]
TOKEN = "replica-fault-token"


class Replica(ServiceProcess):
    """A replica on a port of its own (restarted, it is where nginx looks for it)."""

    def __init__(self, *args: str):
        self.port = free_port()
        super().__init__(*args, "--port", str(self.port), "--max-connections-per-client", "0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stats(self) -> dict:
        return json.loads(http(self.url, path="/v1/stats")[2])["total"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ray_local):
    """Its own PostgreSQL (restarted by a test: no other test's connections to it), two replicas
    that may build (sources, a shared data root, the tests' Ray), nginx in front."""
    root = tmp_path_factory.mktemp("faults")
    videos = media.make_class_folders(root / "videos")
    (root / "tokens").write_text(TOKEN + "\n")
    make_shardset(str(root / "clips"), {"train": CLIPS}, per_shard=4, frames=4, size=(48, 40))
    db = PostgresServer()
    replicas, front = [], None
    try:
        url = db.start().database()
        register(Catalog(url), str(root / "clips"), "clips")
        args = ("--catalog", url, "--token-file", str(root / "tokens"), "--source-root", str(videos), "--data-root",
                str(root / "sets"), "--ray-address", ray_local.get_runtime_context().gcs_address, *accel_flags(str(root)))
        replicas = [Replica(*args) for _ in range(2)]
        for r in replicas:
            r.start()
        front = Front(root / "nginx", [r.address for r in replicas]).start()
        yield {"root": root, "db": db, "url": url, "videos": videos, "replicas": replicas, "front": front}
    finally:
        if front is not None:
            front.stop()
        for r in replicas:
            r.kill(signal.SIGTERM)
        db.close()


def train(data: str, out: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, FAULTRUN, "train",
                             "--data", data, "--output-dir", str(out), *FLAGS],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "EXIT_LOG": str(out / "exits"), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def job(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        top = psutil.Process(proc.pid)
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def ranks_stopped(proc: subprocess.Popen) -> bool:
    """Whether the job's ranks (and their loader workers) are all held by the SIGSTOP faultrun sent
    every process of the job."""
    states = []
    for p in job(proc):
        try:
            if "faultrun.py" in " ".join(p.cmdline()):
                states.append(p.status())
        except psutil.Error:  # gone, or a zombie (faultrun's own `kill`)
            continue
    return len(states) >= 2 and all(s == psutil.STATUS_STOPPED for s in states)


def signal_job(proc: subprocess.Popen, signum: int) -> None:
    for p in job(proc):
        try:
            p.send_signal(signum)
        except psutil.Error:
            continue


def steps_logged(out: Path, rank: int) -> int:
    """How many steps ``rank`` has logged (a step's record is written as it starts)."""
    return sum(r["rank"] == rank for path in (out / "clips").glob("*.jsonl") for r in read_file(str(path)))


def steps_by_epoch(out: Path) -> dict[int, list[dict]]:
    records = [r for path in (out / "clips").glob("*.jsonl") for r in read_file(str(path))]
    return {e: sorted((r for r in records if r["epoch"] == e), key=lambda r: (r["step"], r["rank"]))
            for e in range(1, EPOCHS + 1)}


def test_training_reads_through_a_killed_replica_and_a_catalog_restart_bitwise(cluster, tmp_path):
    front, replicas, db = cluster["front"], cluster["replicas"], cluster["db"]
    data = f"{front.url}/v1/datasets/clips"
    shards = Manifest.load(str(cluster["root"] / "clips")).splits["train"].shards
    keys, shard = [k for s in shards for k in s.keys], shards[0].name

    calm = train(data, tmp_path / "calm")
    calm_log, _ = calm.communicate(timeout=600)
    assert calm.returncode == 0, calm_log[-3000:]

    served = [r.stats()["accel_redirects"] for r in replicas]
    holds = {3: "kill", 7: "restart the replica, stop the catalog", 10: "start the catalog"}  # rank 0's steps
    out = tmp_path / "faults"
    run = train(data, out, {"FAULT": ",".join(f"step:{n}:STOP:job" for n in holds)})
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(run.stdout), daemon=True)
    reader.start()
    postmaster = None
    try:
        for step in holds:  # each fault while the job is held at a step it has not trained yet
            deadline = time.monotonic() + 300
            while not ranks_stopped(run):
                assert run.poll() is None and time.monotonic() < deadline, "".join(output)[-3000:]
                time.sleep(0.05)
            assert steps_logged(out, rank=0) == step  # held exactly there: its record written, the step not run
            if step == 3:
                assert all(r.stats()["accel_redirects"] > s for r, s in zip(replicas, served))  # both served it
                replicas[0].kill(signal.SIGKILL)  # epoch 1, step 3: the job reads on with one replica
            elif step == 7:
                replicas[0].start()  # on its port: nginx uses it again past fail_timeout; a catalog write
                time.sleep(1)  # its notification reaches the other replica (milliseconds)
                postmaster = db.pid()
                db.stop()  # epoch 2, step 1: the job reads on with the catalog down
                status, _, body = http(replicas[1].url, path=f"/v1/datasets/clips/{shard}")
                assert status == 200, body  # a set it knows, after the write, with the catalog down
            else:
                db.start()  # epoch 2, step 4
            signal_job(run, signal.SIGCONT)
            while steps_logged(out, rank=0) == step:  # under way again
                assert run.poll() is None and time.monotonic() < deadline, "".join(output)[-3000:]
                time.sleep(0.05)
        run.wait(timeout=600)
    finally:
        signal_job(run, signal.SIGKILL)
        reader.join(timeout=60)
    assert db.pid() not in (None, postmaster)  # the catalog was restarted
    log = "".join(output)
    assert run.returncode == 0 and "Traceback" not in log, log[-4000:]
    for out in ("calm", "faults"):
        assert [json.loads(line)["exit"] for r in (0, 1)
                for line in (tmp_path / out / f"exits.rank{r}.jsonl").read_text().splitlines()] == [0, 0]
    calm_steps, fault_steps = steps_by_epoch(tmp_path / "calm"), steps_by_epoch(tmp_path / "faults")
    for epoch in range(1, EPOCHS + 1):
        trained = Counter(k for record in fault_steps[epoch] for k in record["keys"])
        assert trained == Counter(keys), f"epoch {epoch}: not every clip once"
        assert [r["weights"] for r in fault_steps[epoch]] == [r["weights"] for r in calm_steps[epoch]]
    a = torch.load(tmp_path / "calm" / "checkpoint.pt", map_location="cpu", weights_only=False)
    b = torch.load(tmp_path / "faults" / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert "connect() failed" in front.errors()  # nginx met the dead replica, and asked the other


def test_an_http_build_survives_the_death_of_the_replica_running_it(cluster):
    front, replicas = cluster["front"], cluster["replicas"]
    body = json.dumps({"src": str(cluster["videos"]), "splits": ["train"], "short_side": 26, "shard_samples": 2,
                       "videos_per_task": 1, "workers": 1}).encode()
    status, _, answer = http(front.url, "POST", "/v1/builds", {"Authorization": f"Bearer {TOKEN}"}, body)
    assert status == 202, answer
    dataset = json.loads(answer)["id"]
    owner = Catalog(cluster["url"]).get(dataset).owner  # the lease: held by the build process once it started
    deadline = time.monotonic() + 120
    while not [r for r in replicas if any(f"build process {owner['pid']} started" in line for line in r.log)]:
        assert time.monotonic() < deadline, "no replica said it started the build"
        owner = Catalog(cluster["url"]).get(dataset).owner
        time.sleep(0.05)
    running = next(r for r in replicas if any(f"build process {owner['pid']} started" in line for line in r.log))
    other = next(r for r in replicas if r is not running)
    builder = psutil.Process(owner["pid"])
    os.killpg(builder.pid, signal.SIGSTOP)  # held: it cannot finish before its replica dies
    running.kill(signal.SIGKILL)
    os.killpg(builder.pid, signal.SIGCONT)  # it finds its server gone and leaves, recording nothing
    builder.wait(timeout=60)
    try:
        done = wait_for(front.url, dataset, ("ready", "failed"))  # a status request finds it orphaned: taken over
        assert done["state"] == "ready" and done["attempts"] == 2, done
        assert any(f"build {dataset}: its builder (" in line and "taken over (attempt 2)" in line for line in other.log)
        assert Manifest.load(done["location"]).splits["train"].num_samples == 4
        status, _, _ = http(front.url, path=f"/v1/datasets/{dataset}/manifest.json")
        assert status == 200
    finally:
        running.start()  # for any test after this one


def test_known_sets_are_read_through_a_catalog_outage_after_a_write_and_refused_once_it_says_so(cluster, tmp_path):
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
    catalog.record_verify(doomed.id, 1, f"{shard[doomed.id]}: bytes differ")  # the write: every replica notified
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
    assert {path: s for (_, path), s in statuses().items()} == {f"/v1/datasets/clips/{shard['clips']}": 200,
                                                              f"/v1/datasets/{doomed.id}/{shard[doomed.id]}": 409}
    for replica, mark in zip(replicas, marks):
        lines = replica.log[mark:]
        assert sum("serving the sets this replica has looked up from their last known records" in line
                   for line in lines) == 1, lines
        assert sum("answers again after" in line for line in lines) == 1, lines


def test_a_record_unconfirmed_past_the_staleness_bound_is_not_served(cluster):
    db, writer = cluster["db"], Catalog(cluster["url"])
    cache = RecordCache(Catalog(cluster["url"]), stale_seconds=1.0)
    try:
        known = cache.resolve("clips")
        seen = cache.catalog.generation()
        writer.tag(known.id, "bounded")
        deadline = time.monotonic() + 30
        while cache.catalog.generation() == seen:
            assert time.monotonic() < deadline, "the tag's notification never arrived"
            time.sleep(0.01)
        db.stop()
        try:
            assert cache.resolve("clips") == known  # unconfirmed, within the bound: its last known record
            with pytest.raises(CatalogUnavailable, match="cannot be reached"):
                cache.resolve("never-looked-up")
            time.sleep(1.2)
            with pytest.raises(CatalogUnavailable, match="unconfirmed for over 1 s, the staleness bound"):
                cache.resolve("clips")
        finally:
            db.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                assert "bounded" in cache.resolve("clips").tags  # the catalog's answer, once it is back
                break
            except CatalogUnavailable:
                assert time.monotonic() < deadline, "the catalog never answered again"
                time.sleep(0.1)
    finally:
        cache.close()
        writer.untag("bounded")
        writer.close()
