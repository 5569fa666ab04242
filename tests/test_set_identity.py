"""A set is one thing, with one identity (issue 26), through the real commands on sets that real
``ingest build`` runs made from the same videos with other options:

* the manifest carries the set's identity (its shard list), which such sets do not share, though
  they share the inputs' fingerprint; a manifest written before identities derives the same one;
* ``trainer train --resume`` and ``ClipLoader.load_state_dict`` on another set are refused in one
  line naming both sets; on the same set elsewhere (moved, or another world size) they go on;
* ``ingest build`` does not replace a set built with other options, nor one a catalog records,
  unless ``--force``, which marks the catalog's record replaced;
* the catalog notices a set whose manifest changed behind its back (``list``, ``show``, the
  server), and the original build rerun says so instead of "up to date";
* registering a finished build (``--catalog`` added; ``--src`` relative or absolute, as the
  manifest holds it or not) decodes nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import media
from helpers.shardsets import ServiceProcess, http

from ingest.cli import main as ingest
from service.cli import main as service
from shards.catalog import Catalog
from shards.format.manifest import Manifest

pytestmark = pytest.mark.usefixtures("ray_local")
BIN = os.path.dirname(sys.executable)
OPTIONS = ["--frames", "4", "--short-side", "24", "--shard-samples", "3", "--workers", "2",
           "--videos-per-task", "2"]
TRAIN = ["--backend", "none", "--segments", "4", "--depth", "10", "--width", "4", "--crop-size", "16",
         "--scale-size", "20", "--batch-size", "2", "--warmup-epochs", "0", "--workers", "0",
         "--no-tensorboard"]


def files(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``directory``: its modification time and SHA-256 (what a rewrite would change)."""
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def one_error(text: str) -> str:
    """The one ``PROG COMMAND: error:`` line of a command's stderr (and no traceback)."""
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if ": error: " in line]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def listed(out: str) -> dict[str, tuple[str, str]]:
    """``shard-service list``'s table: id -> (name, state)."""
    return {line.split()[0]: tuple(line.split()[1:3]) for line in out.splitlines()[1:]}


def build(capsys, *argv: str) -> tuple[int, str, str]:
    """``ingest build ARGV`` as its console script runs it (in this process, on the suite's Ray)."""
    code = ingest(["build", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Videos, and two sets built from them with relative ``--src``: ``two`` (2 clips per training
    video: 8 train clips) and ``one`` (1 clip per video: 4)."""
    root = tmp_path_factory.mktemp("identity")
    for split, n in (("train", 2), ("val", 1)):
        for label in ("left", "right"):
            for i in range(n):
                media.make_video(root / "videos" / split / label / f"{label}{i}.mp4", frames=16 + i, width=40,
                                 height=24)
    here = os.getcwd()
    os.chdir(root)
    try:
        for name, clips in (("two", "2"), ("one", "1")):
            assert ingest(["build", "--src", "videos", "--out", name, "--clips-per-video", clips,
                           *OPTIONS]) == 0
    finally:
        os.chdir(here)
    return root


def test_sets_from_the_same_videos_share_the_fingerprint_not_the_identity(sets):
    two, one = Manifest.load(str(sets / "two")), Manifest.load(str(sets / "one"))
    assert two.fingerprint == one.fingerprint  # the inputs' hash: the same videos
    assert two.identity != one.identity  # the sets: other clips
    assert two.splits["train"].num_samples == 8 and one.splits["train"].num_samples == 4
    saved = json.loads((sets / "two" / "manifest.json").read_bytes())
    assert saved["identity"] == two.identity
    assert saved["config"]["src"] == str(sets / "videos")  # where the inputs were, whatever the spelling
    old = {k: v for k, v in saved.items() if k != "identity"}  # as written before identities
    assert Manifest.from_json(json.dumps(old).encode()).identity == two.identity
    stats = subprocess.run([os.path.join(BIN, "shards"), "stats", str(sets / "two")], capture_output=True,
                           text=True, timeout=120)
    assert stats.stdout.startswith(f"shard set {two.identity}, 2 classes, inputs' fingerprint "
                                   f"{two.fingerprint}")


# --- resume ------------------------------------------------------------------------------------
@pytest.mark.long  # three trainer processes (the refusal alone: test_faults_train.py, in process)
def test_resume_on_a_set_of_other_options_is_refused_naming_both_and_goes_on_where_the_set_moved(
        sets, tmp_path):
    """Before: a run of the 8-clip set resumed silently on the 4-clip set (same fingerprint)."""
    run = tmp_path / "run"
    trainer = os.path.join(BIN, "trainer")
    first = subprocess.run([trainer, "train", "--data", str(sets / "two"), "--output-dir", str(run),
                            "--epochs", "1", *TRAIN],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    kept = files(run)
    other = subprocess.run([trainer, "train", "--data", str(sets / "one"), "--output-dir", str(run),
                            "--resume", "--epochs", "2", *TRAIN], capture_output=True, text=True, timeout=300)
    line = one_error(other.stderr)
    two, one = (Manifest.load(str(sets / s)) for s in ("two", "one"))
    assert other.returncode == 2
    assert line == (f"trainer train: error: --resume refused: {run / 'checkpoint.pt'} was trained on shard "
                    f"set {two.identity[:16]} (8 train + 2 val clips, 4 frames, 2 clips per video, short "
                    f"side 24), but --data is shard set {one.identity[:16]} (4 train + 2 val clips, 4 "
                    f"frames, short side 24) at {sets / 'one'}: resume with --data naming the run's set, or "
                    "start afresh (--overwrite, or another --output-dir)")
    assert files(run) == kept  # checkpoint, metrics: untouched
    moved = tmp_path / "moved"  # the same set elsewhere: the same identity, resumed
    shutil.copytree(sets / "two", moved)
    same = subprocess.run([trainer, "train", "--data", str(moved), "--output-dir", str(run), "--resume",
                           "--epochs", "1", *TRAIN],
                          capture_output=True, text=True, timeout=300)
    assert same.returncode == 0 and "resumed from" in same.stderr, same.stderr[-3000:]


def test_a_loader_position_continues_on_its_set_at_any_world_size_and_nowhere_else(sets):
    from trainer.data.loader import ClipLoader, EpochOptions, OtherShardSet

    def loader(name: str, world: int = 2, rank: int = 0) -> ClipLoader:
        return ClipLoader(str(sets / name), "train", EpochOptions(batch_size=1, world_size=world, rank=rank),
                          num_workers=0, crop_size=16, scale_size=20)

    two = loader("two")
    it = iter(two)
    next(it)
    state = two.state_dict()
    del it
    elastic = loader("two", world=1)  # the same set, another world size: the epoch goes on
    elastic.load_state_dict(state)
    assert len(elastic) == 8 - 2  # every clip the 2 ranks had not read yet, once
    with pytest.raises(OtherShardSet) as refused:
        loader("one").load_state_dict(state)
    message = str(refused.value)
    ident = {s: Manifest.load(str(sets / s)).identity[:16] for s in ("two", "one")}
    assert ("\n" not in message
            and message.startswith(f"a loader position saved on shard set {ident['two']} (8 train"))
    assert f"cannot continue on shard set {ident['one']} (4 train" in message and str(sets / "one") in message


# --- ingest build: no set replaced unasked ----------------------------------------------------
def test_a_build_with_other_options_does_not_replace_a_set_unless_forced(sets, tmp_path, capsys, monkeypatch):
    """Before: ``ingest build`` into the --out of a set with --frames 8 instead of 4 replaced it silently."""
    monkeypatch.setenv("SHARD_SERVICE_CATALOG", str(tmp_path / "none.sqlite"))  # no catalog to consult
    out = tmp_path / "set"
    shutil.copytree(sets / "two", out)
    before = files(out)
    code, _, err = build(capsys, "--src", str(sets / "videos"), "--out", str(out), "--clips-per-video", "2",
                         *OPTIONS[:1], "8", *OPTIONS[2:])
    assert code == 2 and one_error(err) == (
        f"ingest build: error: --out {out} holds a shard set built with other options (--frames 4, now 8); "
        "--force replaces it, or choose another --out")
    assert files(out) == before and not (tmp_path / "none.sqlite").exists()


def test_a_set_a_catalog_records_is_replaced_only_with_force_and_its_record_says_so(sets, tmp_path, capsys,
                                                                                      monkeypatch):
    """The served set of a catalog: a build without --catalog into its directory, with other
    options, is refused, and with --force marks the catalog's record replaced (the server then
    answers 410, naming the build that replaced it), instead of ``ready`` and 500s."""
    catalog = str(tmp_path / "catalog.sqlite")
    monkeypatch.setenv("SHARD_SERVICE_CATALOG", catalog)
    out = tmp_path / "served"
    shutil.copytree(sets / "two", out)
    code, stdout, _ = build(capsys, "--src", str(sets / "videos"), "--out", str(out), "--catalog", catalog,
                            "--clips-per-video", "2", *OPTIONS)
    assert code == 0 and "up to date" in stdout  # registered as it is: nothing decoded
    (rec,) = Catalog(catalog).list()
    fewer = tmp_path / "fewer"  # the same options, other inputs: rebuilt, were the set not registered
    shutil.copytree(sets / "videos", fewer)
    (fewer / "train" / "left" / "left1.mp4").unlink()
    code, _, err = build(capsys, "--src", str(fewer), "--out", str(out), "--clips-per-video", "2", *OPTIONS)
    assert code == 1 and one_error(err) == (
        f"ingest build: error: {out} already holds dataset {rec.id} (served); --force replaces it (the "
        f"catalog records it as replaced), or build into another location (it is registered in the catalog "
        f"{catalog})")
    eight = [*OPTIONS[:1], "8", *OPTIONS[2:]]
    code, _, err = build(capsys, "--src", str(sets / "videos"), "--out", str(out), "--clips-per-video", "2",
                         *eight)
    assert code == 2 and "--force replaces it" in one_error(err)
    assert Catalog(catalog).get(rec.id).state == "ready"
    code, _, err = build(capsys, "--src", str(sets / "videos"), "--out", str(out), "--clips-per-video", "2",
                         *eight, "--force")
    assert code == 0, err
    assert Manifest.load(str(out)).config["clip"]["frames"] == 8
    gone = Catalog(catalog).get(rec.id)
    assert (gone.state, gone.replaced_by) == ("deleted", "") and gone.replaced is not None
    assert service(["list", "--catalog", catalog]) == 0 and rec.id[:12] not in capsys.readouterr().out
    assert service(["list", "--all", "--catalog", catalog]) == 0
    assert listed(capsys.readouterr().out)[rec.id[:12]] == ("served", "replaced")
    assert service(["show", rec.id, "--catalog", catalog]) == 2
    assert (f"dataset {rec.id} (served) is replaced: a build without a catalog was forced into {out}"
            in one_error(capsys.readouterr().err))
    server = ServiceProcess("--catalog", catalog)
    server.start()
    try:
        status, _, body = http(server.url, path=f"/v1/datasets/{rec.id}/manifest.json")
    finally:
        server.kill(15)
    assert status == 410 and "is replaced" in json.loads(body)["error"]


def test_a_forced_build_into_a_set_of_the_same_catalog_marks_it_replaced_by_the_new_set(
        sets, tmp_path, capsys):
    catalog = str(tmp_path / "catalog.sqlite")
    out = tmp_path / "shared"
    shutil.copytree(sets / "one", out)
    common = ["--src", str(sets / "videos"), "--out", str(out), "--catalog", catalog]
    assert build(capsys, *common, *OPTIONS)[0] == 0
    (old,) = Catalog(catalog).list()
    code, _, err = build(capsys, *common, "--clips-per-video", "2", *OPTIONS)
    assert (code == 2
            and "holds a shard set built with other options (--clips-per-video 1, now 2)" in one_error(err))
    code, stdout, err = build(capsys, *common, "--clips-per-video", "2", *OPTIONS, "--force")
    assert code == 0, err
    new = Catalog(catalog).resolve("shared")
    assert new.id != old.id and new.state == "ready" and new.splits["train"]["clips"] == 8
    assert Catalog(catalog).get(old.id).replaced_by == new.id


# --- the catalog notices a set changed behind its back -----------------------------------------
def test_a_set_changed_behind_the_catalog_is_shown_changed_refused_by_the_server_and_by_the_original_build(
        sets, tmp_path, capsys):
    """Before: ``list`` said ready, the server answered 500 and the original build said "up to date"."""
    catalog = str(tmp_path / "catalog.sqlite")
    out = tmp_path / "served"
    shutil.copytree(sets / "two", out)
    original = ["--src", str(sets / "videos"), "--out", str(out), "--catalog", catalog,
                "--clips-per-video", "2", *OPTIONS]
    assert build(capsys, *original)[0] == 0
    (rec,) = Catalog(catalog).list()
    shutil.rmtree(out)
    shutil.copytree(sets / "one", out)  # as a build without this catalog would leave it
    assert service(["list", "--catalog", catalog]) == 0
    assert listed(capsys.readouterr().out) == {rec.id[:12]: ("served", "changed")}
    assert service(["show", "served", "--catalog", catalog]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["state"] == "changed" and shown["problem"] == (
        f"{out}/manifest.json changed since the set was registered: it describes 4 train + 2 val clips, 4 "
        "frames, short side 24, the record 8 train + 2 val clips, 4 frames, 2 clips per video, short side "
        "24: the files there are not the registered set")
    server = ServiceProcess("--catalog", catalog)
    server.start()
    try:
        shard = Manifest.load(str(out)).splits["train"].shards[0].name
        answers = [http(server.url, path=f"/v1/datasets/served/{name}") for name in ("manifest.json", shard)]
        datasets = json.loads(http(server.url, path="/v1/datasets")[2])["datasets"]
        kept = files(out)
        code, stdout, err = build(capsys, *original)  # the original build, run again
        assert code == 1 and "up to date" not in stdout
        assert one_error(err) == (f"ingest build: error: dataset {rec.id} (served) is changed: "
                                  f"{shown['problem']}; --force rebuilds it there, "
                                  f"or shard-service remove {rec.id[:12]} forgets it")
        assert files(out) == kept
        code, stdout, err = build(capsys, *original, "--force")
        assert code == 0 and "registered" in stdout, err
        repaired = http(server.url, path="/v1/datasets/served/manifest.json")
    finally:
        server.kill(15)
    for status, _, body in answers:
        assert (status == 409
                and json.loads(body)["error"].startswith(f"dataset {rec.id} (served) is changed: "))
    assert [(d["id"], d["state"]) for d in datasets] == [(rec.id, "changed")]
    assert (repaired[0] == 200
            and hashlib.sha256(repaired[2]).hexdigest() == Catalog(catalog).get(rec.id).manifest_sha256)
    assert Manifest.load(str(out)).identity == Manifest.load(str(sets / "two")).identity  # the set it was


# --- registering a finished build ---------------------------------------------------------------
@pytest.mark.parametrize("manifest_src, given", [("absolute", "relative"), ("relative", "absolute"),
                                                 ("relative", "relative")])
def test_registering_a_finished_build_decodes_nothing(sets, tmp_path, capsys, monkeypatch, manifest_src,
                                                      given):
    """Before: adding --catalog to a build made with a relative --src decoded every video again (the
    manifest's src was relative, the catalog's absolute). ``manifest_src``: how the finished set's
    manifest holds it (builds before this change kept it as given; builds now, absolute)."""
    monkeypatch.chdir(sets)
    out = tmp_path / "finished"
    shutil.copytree(sets / "two", out)
    if manifest_src == "relative":
        m = json.loads((out / "manifest.json").read_bytes())
        m["config"]["src"] = "videos"
        (out / "manifest.json").write_text(json.dumps(m))
    before = files(out)
    src = "videos" if given == "relative" else str(sets / "videos")
    code, stdout, err = build(capsys, "--src", src, "--out", str(out), "--catalog",
                              str(tmp_path / "catalog.sqlite"),
                              "--clips-per-video", "2", *OPTIONS)
    assert code == 0, err
    (rec,) = Catalog(str(tmp_path / "catalog.sqlite")).list()
    assert (f"dataset {rec.id} (finished) at {out}" in stdout
            and "up to date: 6 videos in, 10 clips out" in stdout)
    assert files(out) == before  # not a byte rewritten, nothing staged
    assert rec.state == "ready" and rec.source == str(sets / "videos")
