"""The catalog on both back ends, each real (a SQLite file; a database of a PostgreSQL server
started on loopback: the ``catalog_location`` fixture): schema versions and migrations, atomic
claims across processes, leases, tags moved under a concurrent writer, verify results and
replaced records, the generation caches key on, and a server that cannot be reached."""
from __future__ import annotations

import multiprocessing
import socket
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


def test_a_newer_schema_is_refused(catalog_location):
    cat = Catalog(catalog_location)
    with cat._write() as db:
        cat.backend.set_version(db, SCHEMA_VERSION + 1)
    cat.close()
    with pytest.raises(CatalogError, match=f"version {SCHEMA_VERSION + 1} is newer"):
        Catalog(catalog_location)


def tables(cat: Catalog) -> set[str]:
    sql = ("SELECT name FROM sqlite_master WHERE type = 'table'"
           if cat.backend.__class__.__name__ == "SQLite" else
           "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")
    return {row[0] for row in cat._db.execute(sql).fetchall()}


def test_migrations_apply_in_one_transaction(catalog_location):
    cat = Catalog(catalog_location)
    assert cat.schema_version() == SCHEMA_VERSION and {"datasets", "tags"} <= tables(cat)
    broken = MIGRATIONS + [["CREATE TABLE extra (x INTEGER)", "THIS IS NOT SQL"]]
    with pytest.raises(CatalogError,
                       match=f"schema migration {SCHEMA_VERSION + 1} failed .*; the catalog stays at "
                                           f"version {SCHEMA_VERSION}"):
        Catalog(catalog_location, migrations=broken)
    assert cat.schema_version() == SCHEMA_VERSION and "extra" not in tables(cat)
    fixed = MIGRATIONS + [["CREATE TABLE extra (x INTEGER)"]]
    assert Catalog(catalog_location, migrations=fixed).schema_version() == SCHEMA_VERSION + 1
    assert "extra" in tables(cat)


def test_times_keep_their_fraction_of_a_second(catalog_location):
    """PostgreSQL's REAL is single precision (a Unix time to the minute): the migrations' REAL
    columns are DOUBLE PRECISION there."""
    cat = Catalog(catalog_location)
    claim(cat)
    cat._db.execute("UPDATE datasets SET heartbeat = ?", (1795790731.845,))
    assert cat.get(ID).heartbeat == 1795790731.845


def _claim_in_process(path, barrier, results):
    cat = Catalog(path)
    barrier.wait()
    results.put(claim(cat).action)


def test_concurrent_claims_from_processes_make_one_builder(catalog_location):
    path = catalog_location
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


def test_a_dead_builder_is_taken_over_and_loses_its_lease(catalog_location):
    cat = Catalog(catalog_location)
    # a builder process that claims and dies without finishing
    code = ("from shards.catalog import Catalog; "
            f"Catalog({catalog_location!r}).claim({ID!r}, source='/videos', location='/sets/a', "
            "options={'frames': 8})")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert cat.get(ID).state == "building"
    assert cat.reap() == [ID]
    rec = cat.get(ID)
    assert rec.state == "failed" and "abandoned" in rec.error
    taken = claim(cat)
    assert taken.action == "build" and taken.record.attempts == 2


def test_stale_heartbeat_from_another_host_expires(catalog_location):
    cat = Catalog(catalog_location)
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


def test_resolve_names_tags_and_prefixes(catalog_location):
    cat = Catalog(catalog_location)
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


def test_untagging_a_set_leaves_a_tag_another_writer_has_just_moved(catalog_location):
    path = catalog_location
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


def test_verify_results_and_replaced_records(catalog_location):
    cat = Catalog(catalog_location)
    first = claim(cat, name="k400")
    assert cat.finish(ID, first.owner, splits={"train": {"clips": 4}}, files={}, manifest_sha256="m",
                      builder_version="0", verified_files={"train/a.tar": [10, 5, "aa"]})
    cat.record_verify(ID, 0, "ok", {"train/a.tar": [10, 6, "aa"], "train/b.tar": [20, 7, "bb"]})
    cat.record_file_verify(ID, "train/b.tar", [20, 8, "cc"],
                           "train/b.tar: its bytes are not the registered ones")
    rec = cat.get(ID)
    assert rec.verified_files == {"train/a.tar": [10, 6, "aa"], "train/b.tar": [20, 8, "cc"]}
    assert (rec.verify_problems, rec.verify_detail) == (1,
                                                        "train/b.tar: its bytes are not the registered ones")
    with pytest.raises(CatalogError, match="--force replaces it"):
        claim(cat, dataset="ac" * 32)
    # forced into its location: the old one replaced
    forced = claim(cat, dataset="ac" * 32, name="k400", force=True)
    assert forced.action == "build" and cat.resolve("k400").id == "ac" * 32
    gone = cat.get(ID)
    assert (gone.state, gone.replaced_by, gone.name) == ("deleted", "ac" * 32, "k400") and gone.replaced
    assert cat.replaced("k400").id == ID and cat.replaced(ID[:8]).id == ID and cat.replaced("ac" * 3) is None
    assert [r.id for r in cat.replace_at("/sets/elsewhere", force=False)] == []


def _tag_in_process(path: str) -> None:
    Catalog(path).tag(ID, "moved")


def test_every_commit_changes_the_generation_another_process_sees(catalog_location):
    """What the server's caches key on (``service.records``): any commit, by any process, changes
    it (on PostgreSQL it arrives as a notification, so it is waited for, not assumed at once)."""
    reader, writer = Catalog(catalog_location), Catalog(catalog_location)
    claim(writer)
    before = reader.generation()
    assert reader.generation() == before  # nothing committed: the same
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_tag_in_process, args=(catalog_location,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    deadline = time.monotonic() + 30
    while reader.generation() == before:
        assert time.monotonic() < deadline, "another process's commit never changed the generation"
        time.sleep(0.01)
    now = reader.generation()
    reader.tag(ID, "mine")  # this process's own commit: at once
    assert reader.generation() != now


def test_a_catalog_server_that_cannot_be_reached_is_one_line_naming_it():
    from shards.catalog import CatalogUnavailable

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://kf:secret@127.0.0.1:{port}/catalog"
    with pytest.raises(CatalogUnavailable) as e:
        Catalog(url)
    message = str(e.value)
    assert message.startswith(f"the catalog postgresql://kf:***@127.0.0.1:{port}/catalog cannot be reached: ")
    assert "secret" not in message and "\n" not in message and e.value.status == 75


def test_dataset_id_is_canonical():
    a = [{"path": "/v/a.mp4", "size": 1, "mtime": 5.0}, {"path": "/v/b.mp4", "size": 2, "mtime": 6.0}]
    assert dataset_id(a, {"frames": 8, "seed": 0}) == dataset_id(a[::-1], {"seed": 0, "frames": 8})
    assert dataset_id(a, {"frames": 8}) != dataset_id(a, {"frames": 16})
    assert dataset_id(a, {"frames": 8}) != dataset_id([a[0], {**a[1], "mtime": 7.0}], {"frames": 8})
    assert dataset_id(a, {"frames": 8}) != dataset_id(a, {"frames": 8}, shard_format="kinetics-fast-shards/1")
    assert len(dataset_id(a, {})) == 64 and new_owner()["token"] != new_owner()["token"]


@pytest.mark.long
def test_a_restarted_postgresql_is_reconnected_to_and_a_write_it_cut_is_one_line():
    """A server of its own (restarted twice: no other test's sessions on it). A session lost while
    idle is replaced at the next statement; a transaction cut midway is CatalogUnavailable, undone,
    and the catalog answers again once the server is back; the generation moves on reconnection."""
    from helpers.postgres import PostgresServer

    from shards.catalog import CatalogUnavailable

    server = PostgresServer()
    try:
        cat = Catalog(server.start().database())
        claim(cat)
        seen = cat.generation()
        server.restart()
        assert cat.get(ID).state == "building"  # a new session, at once
        deadline = time.monotonic() + 30
        while cat.generation() == seen:  # the listener is back, and says commits may have been missed
            assert time.monotonic() < deadline, "the generation never moved after the restart"
            time.sleep(0.05)
        with pytest.raises(CatalogUnavailable, match="cannot be reached"):
            with cat._write() as db:
                db.execute("UPDATE datasets SET heartbeat = ?", (1.0,))
                server.stop("immediate")
                db.execute("UPDATE datasets SET attempts = 99")
        with pytest.raises(CatalogUnavailable):
            cat.get(ID)
        server.start()
        rec = cat.get(ID)
        assert rec.heartbeat != 1.0 and rec.attempts == 1  # the cut transaction left nothing
    finally:
        server.close()
