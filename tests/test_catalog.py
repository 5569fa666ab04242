"""The catalog on real SQLite files: schema versions, atomic claims across processes, leases."""
from __future__ import annotations

import multiprocessing
import sqlite3
import subprocess
import sys
import time

import pytest

from shards.catalog import Catalog, CatalogError, dataset_id, new_owner
from shards.catalog.schema import MIGRATIONS, SCHEMA_VERSION

ID = "ab" * 32


def claim(cat: Catalog, dataset=ID, location="/sets/a", **kw):
    return cat.claim(dataset, source="/videos", location=location, options={"frames": 8}, **kw)


def test_new_file_is_wal_at_the_current_schema_version(tmp_path):
    cat = Catalog(str(tmp_path / "c.sqlite"))
    assert cat.schema_version() == SCHEMA_VERSION
    raw = sqlite3.connect(tmp_path / "c.sqlite")
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "c.sqlite"
    Catalog(str(path)).close()
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(CatalogError, match=f"version {SCHEMA_VERSION + 1} is newer"):
        Catalog(str(path))


def test_migrations_apply_in_one_transaction(tmp_path):
    path = str(tmp_path / "c.sqlite")
    Catalog(path).close()
    broken = MIGRATIONS + [["CREATE TABLE extra (x INTEGER)", "THIS IS NOT SQL"]]
    with pytest.raises(sqlite3.OperationalError):
        Catalog(path, migrations=broken)
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert not raw.execute("SELECT name FROM sqlite_master WHERE name = 'extra'").fetchone()
    fixed = MIGRATIONS + [["CREATE TABLE extra (x INTEGER)"]]
    assert Catalog(path, migrations=fixed).schema_version() == SCHEMA_VERSION + 1


def _claim_in_process(path, barrier, results):
    cat = Catalog(path)
    barrier.wait()
    results.put(claim(cat).action)


def test_concurrent_claims_from_processes_make_one_builder(tmp_path):
    path = str(tmp_path / "c.sqlite")
    Catalog(path).close()
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_claim_in_process, args=(path, barrier, results)) for _ in range(6)]
    for p in procs:
        p.start()
    actions = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join()
    assert actions == ["build"] + ["wait"] * 5
    assert Catalog(path).get(ID).attempts == 1


def test_a_dead_builder_is_taken_over_and_loses_its_lease(tmp_path):
    cat = Catalog(str(tmp_path / "c.sqlite"))
    # a builder process that claims and dies without finishing
    code = ("from shards.catalog import Catalog; "
            f"Catalog({str(tmp_path / 'c.sqlite')!r}).claim({ID!r}, source='/videos', location='/sets/a', "
            "options={'frames': 8})")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert cat.get(ID).state == "building"
    assert cat.reap() == [ID]
    rec = cat.get(ID)
    assert rec.state == "failed" and "abandoned" in rec.error
    taken = claim(cat)
    assert taken.action == "build" and taken.record.attempts == 2


def test_stale_heartbeat_from_another_host_expires(tmp_path):
    cat = Catalog(str(tmp_path / "c.sqlite"))
    remote = {"host": "elsewhere", "pid": 1, "token": "t"}
    first = claim(cat, owner=remote)
    assert claim(cat).action == "wait"
    cat._db.execute("UPDATE datasets SET heartbeat = ?", (time.time() - 3600,))
    second = claim(cat)
    assert second.action == "build"
    assert not cat.heartbeat(ID, first.owner)  # the old owner learns it lost the record
    assert not cat.finish(ID, remote, splits={}, files={}, manifest_sha256="x", builder_version="0")
    assert cat.finish(ID, second.owner, splits={"train": {"clips": 1}}, files={}, manifest_sha256="x",
                      builder_version="0")
    assert cat.get(ID).state == "ready" and claim(cat).action == "reuse"
    assert claim(cat, force=True).action == "build"


def test_resolve_names_tags_and_prefixes(tmp_path):
    cat = Catalog(str(tmp_path / "c.sqlite"))
    other = "ac" + "0" * 62
    claim(cat, name="k400")
    claim(cat, dataset=other, location="/sets/b", name="k400")  # name taken: suffixed with the id
    assert cat.get(other).name == f"k400-{other[:8]}"
    with pytest.raises(CatalogError, match="belongs to another"):
        claim(cat, dataset="ad" * 32, location="/sets/c", name="k400", strict_name=True)
    with pytest.raises(CatalogError, match="already holds dataset"):
        claim(cat, dataset="ae" * 32, location="/sets/a")
    assert cat.tag(ID, "prod") is None
    assert cat.tag(other, "prod") == ID  # a tag moves
    assert cat.resolve("k400").id == ID and cat.resolve("prod").id == other
    assert cat.resolve(ID[:6]).id == ID and cat.resolve(other[:10]).id == other
    assert cat.resolve("a") is None and cat.resolve("nothing") is None
    with pytest.raises(CatalogError, match="tagged prod"):
        cat.mark_deleted(other)
    assert cat.untag("prod") and not cat.untag("prod")
    cat._db.execute("UPDATE datasets SET state = 'failed'")
    cat.mark_deleted(other)
    assert cat.resolve(other) is None and cat.get(other).state == "deleted"
    assert [r.id for r in cat.list()] == [ID]


def test_untagging_a_set_leaves_a_tag_another_writer_has_just_moved(tmp_path):
    path = str(tmp_path / "c.sqlite")
    server, other_writer = Catalog(path), Catalog(path)  # two connections, as two processes
    moved_to = "ac" + "0" * 62
    claim(server)
    claim(server, dataset=moved_to, location="/sets/b")
    server.tag(ID, "prod")
    assert "prod" in server.get(ID).tags  # DELETE /v1/datasets/{ID}/tags/prod has found it on ID ...
    other_writer.tag(moved_to, "prod")  # ... and another writer moves it before the delete runs
    assert not server.untag("prod", ID)
    assert other_writer.resolve("prod").id == moved_to and server.get(moved_to).tags == ["prod"]
    assert server.untag("prod", moved_to) and server.resolve("prod") is None


def test_dataset_id_is_canonical():
    a = [{"path": "/v/a.mp4", "size": 1, "mtime": 5.0}, {"path": "/v/b.mp4", "size": 2, "mtime": 6.0}]
    assert dataset_id(a, {"frames": 8, "seed": 0}) == dataset_id(a[::-1], {"seed": 0, "frames": 8})
    assert dataset_id(a, {"frames": 8}) != dataset_id(a, {"frames": 16})
    assert dataset_id(a, {"frames": 8}) != dataset_id([a[0], {**a[1], "mtime": 7.0}], {"frames": 8})
    assert dataset_id(a, {"frames": 8}) != dataset_id(a, {"frames": 8}, shard_format="kinetics-fast-shards/2")
    assert len(dataset_id(a, {})) == 64 and new_owner()["token"] != new_owner()["token"]
