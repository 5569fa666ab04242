"""``shard-service list | show | tag | untag | verify | remove | gc`` on a real catalog file and
real shard sets: gc is a dry run unless told and spares tagged sets and live builds; remove
deletes files only with --purge, and only what a build wrote; verify records its outcome."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.shardsets import make_shardset, register

from service.cli import main
from shards.catalog import Catalog


@pytest.fixture
def catalog(tmp_path):
    cat = Catalog(str(tmp_path / "catalog.sqlite"))
    sets = {}
    for name in ("good", "tagged-ready", "failed", "failed-tagged", "abandoned", "live"):
        make_shardset(str(tmp_path / name), {"train": 10, "val": 5}, per_shard=5)
        (tmp_path / name / "notes.txt").write_text("not written by a build")
        sets[name] = register(cat, str(tmp_path / name), name)
    cat.tag(sets["tagged-ready"].id, "paper")
    cat.tag(sets["failed-tagged"].id, "keep")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True)
    for name, owner in (("failed", None), ("failed-tagged", None), ("abandoned", int(dead.stdout)),
                        ("live", os.getpid())):
        state = "failed" if owner is None else "building"
        cat._db.execute("UPDATE datasets SET state = ?, owner = ?, heartbeat = strftime('%s','now') "
                        "WHERE id = ?",
                        (state, None if owner is None
                         else json.dumps({"host": os.uname().nodename, "pid": owner, "token": "t"}),
                         sets[name].id))
    return cat, sets, tmp_path


def cli(cat, *args) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main([args[0], "--catalog", cat.path, *args[1:]])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (print(e.code) or 1)
    return code, out.getvalue()


def test_gc_is_a_dry_run_unless_told_and_spares_tagged_sets_and_live_builds(catalog):
    cat, sets, root = catalog
    code, out = cli(cat, "gc")
    assert code == 0 and "dry run" in out
    assert {line.split()[2] for line in out.splitlines() if line.startswith("would remove")} == \
        {sets["failed"].id, sets["abandoned"].id}
    assert all((root / n / "manifest.json").exists() for n in sets)
    code, out = cli(cat, "gc", "--yes")
    assert code == 0
    for name in ("failed", "abandoned"):
        assert cat.get(sets[name].id).state == "deleted"
        assert sorted(os.listdir(root / name)) == ["notes.txt"]  # only what the build wrote is gone
    for name in ("good", "tagged-ready", "failed-tagged", "live"):
        assert (root / name / "train" / "train-000000.tar").exists()
    assert (cat.get(sets["live"].id).state == "building"
            and cat.get(sets["failed-tagged"].id).state == "failed")


def test_remove_deletes_files_only_with_purge_and_never_a_tagged_set(catalog):
    cat, sets, root = catalog
    code, out = cli(cat, "remove", "tagged-ready")
    assert code == 1 and "untag it first" in out
    code, out = cli(cat, "remove", "good")
    assert code == 0 and "files kept" in out and (root / "good" / "manifest.json").exists()
    assert cat.resolve("good") is None and cat.get(sets["good"].id).state == "deleted"
    assert cli(cat, "untag", "paper")[0] == 0
    code, out = cli(cat, "remove", sets["tagged-ready"].id[:10], "--purge")
    assert code == 0 and sorted(os.listdir(root / "tagged-ready")) == ["notes.txt"]
    assert cli(cat, "remove", "live")[0] == 1  # being built


def test_verify_records_its_outcome_and_list_show_tag(catalog):
    cat, sets, root = catalog
    assert cli(cat, "verify", "good")[0] == 0
    assert cat.get(sets["good"].id).verify_problems == 0
    shard = root / "good" / "val" / "val-000000.tar"
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out = cli(cat, "verify", sets["good"].id)
    rec = cat.get(sets["good"].id)
    assert (code == 1 and "SHA-256 differs" in out and rec.verify_problems >= 1
            and "val-000000" in rec.verify_detail)
    code, out = cli(cat, "list")  # a set verify found bad is not listed as sound
    assert {line.split()[1]: line.split()[2] for line in out.splitlines()[1:]}["good"] == "damaged"
    shown = json.loads(cli(cat, "show", "good")[1])
    assert "val-000000" in shown["problem"] and f"shard-service verify {rec.id[:12]}" in shown["remedy"]
    manifest = root / "good" / "manifest.json"  # changed bytes, still a manifest
    manifest.write_text(json.dumps(json.loads(manifest.read_text()), indent=2))
    code, out = cli(cat, "verify", "good")
    assert code == 1 and "changed since the set was registered" in out
    assert cli(cat, "tag", "good", "v1")[0] == 0 and cli(cat, "tag", "good", "bad tag")[0] == 1
    code, out = cli(cat, "show", "v1")
    shown = json.loads(out)
    assert code == 0 and shown["tags"] == ["v1"] and shown["state"] == "changed"
    assert "manifest.json changed since the set was registered" in shown["problem"]
    # its manifest is not the registered one: not ready, whatever the record says
    code, out = cli(cat, "list")
    states = {line.split()[1]: line.split()[2] for line in out.splitlines()[1:]}
    assert states == {"good": "changed", "tagged-ready": "ready", "failed": "failed",
                      "failed-tagged": "failed",
                      "abandoned": "abandoned", "live": "building"}
    assert cli(cat, "show", "nothing")[0] == 2  # no such dataset: a usage error


def test_list_on_a_terminal_colours_each_state_and_only_a_sound_set_green(catalog):
    """Each state in its tone's colour (service.states) when stdout is a terminal (a real
    pseudo-terminal here), plain into a pipe or with $NO_COLOR."""
    import pty
    import re

    from service.states import ANSI, STATES

    cat, sets, _ = catalog
    good = cat.get(sets["good"].id)
    cat.record_verify(good.id, 2, "val/val-000000.tar: SHA-256 differs", good.verified_files)
    argv = [sys.executable, "-m", "service", "list", "--catalog", cat.path]

    def on_a_terminal(env) -> str:
        master, slave = pty.openpty()
        proc = subprocess.Popen(argv, stdout=slave, stderr=subprocess.DEVNULL, env=env)
        os.close(slave)
        out = b""
        while chunk := _read(master):
            out += chunk
        os.close(master)
        assert proc.wait(timeout=60) == 0
        return out.decode()

    painted = {}
    for line in on_a_terminal(dict(os.environ)).splitlines()[1:]:
        name, sgr, state = re.match(r"\w+\s+(\S+)\s+\x1b\[([\d;]+)m(\w+)\x1b\[0m", line).groups()
        painted[name] = (state, sgr)
    assert painted == {"good": ("damaged", ANSI["bad"]), "tagged-ready": ("ready", ANSI["good"]),
                       "failed": ("failed", ANSI["bad"]), "failed-tagged": ("failed", ANSI["bad"]),
                       "abandoned": ("abandoned", ANSI["warn"]), "live": ("building", ANSI["busy"])}
    assert [s for s, (_, sgr) in painted.items() if sgr == ANSI["good"]] == ["tagged-ready"]  # the only green
    assert all(STATES[state].tone in ANSI for state, _ in painted.values())
    assert "\x1b[" not in on_a_terminal({**os.environ, "NO_COLOR": "1"})
    piped = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert "\x1b[" not in piped and {line.split()[1]: line.split()[2]
                                     for line in piped.splitlines()[1:]}["good"] == \
        "damaged"


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # the terminal's other end closed (EIO)
        return b""
