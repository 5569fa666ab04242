"""``ingest build`` on UCF101 and HMDB51 as they are distributed, with ``--split-set``.

Tiny stand-ins of both layouts: the real file-name patterns (``v_<Class>_gXX_cYY.avi``, HMDB's
``<source>_<class>_<tags>_<n>.avi``), the real split files (UCF's ``classInd.txt`` numbered from
1, ``trainlistNN.txt`` lines ending with that number, ``testlistNN.txt`` without it, CRLF line
ends; HMDB's ``<class>_test_splitN.txt`` lines ``<name>.avi 1|2|0 ``) and one real MPEG-4 AVI
copied under every name.
"""
from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
from helpers import media
from helpers.runbooks import block_commands, ran

from ingest import cli
from ingest.sources import discover
from shards.format.manifest import Manifest
from shards.format.sample import parse
from shards.tools import verify

# classInd's numbering on purpose not alphabetical, so the test tells its order from a sort
UCF_CLASSES = ["Archery", "ApplyEyeMakeup", "HandstandPushups"]
UCF_FILE_CLASS = {"HandstandPushups": "HandStandPushups"}  # the real archive's spelling in file names
HMDB_CLASSES = ["brush_hair", "cartwheel", "catch"]


def _ucf_name(cls: str, group: int) -> str:
    return f"{cls}/v_{UCF_FILE_CLASS.get(cls, cls)}_g{group:02d}_c01.avi"


@pytest.fixture(scope="module")
def avi(tmp_path_factory) -> Path:
    return media.make_mpeg4_avi(tmp_path_factory.mktemp("avi") / "one.avi")


@pytest.fixture(scope="module")
def ucf101(tmp_path_factory, avi) -> Path:
    """Three classes of three groups; split set N tests on group N and trains on the others.
    The videos sit under UCF-101/, as the archive unpacks; one video is listed but missing."""
    root = tmp_path_factory.mktemp("ucf")
    lists = root / "ucfTrainTestlist"
    lists.mkdir()
    (lists / "classInd.txt").write_bytes("".join(f"{i + 1} {c}\r\n" for i,
                                                 c in enumerate(UCF_CLASSES)).encode())
    for n in (1, 2, 3):
        train = [f"{_ucf_name(c, g)} {i + 1}\r\n" for i, c in enumerate(UCF_CLASSES) for g in (1, 2, 3)
                 if g != n]
        test = [f"{_ucf_name(c, n)}\r\n" for c in UCF_CLASSES]
        (lists / f"trainlist{n:02d}.txt").write_bytes("".join(train).encode())
        (lists / f"testlist{n:02d}.txt").write_bytes("".join(test).encode())
    for c in UCF_CLASSES:
        for g in (1, 2, 3):
            if (c, g) != ("Archery", 3):
                target = root / "UCF-101" / _ucf_name(c, g)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(avi, target)
    return root


def _hmdb_name(cls: str, k: int) -> str:
    return f"Video_{k}_{cls}_f_cm_np1_ri_med_{k}.avi"


@pytest.fixture(scope="module")
def hmdb51(tmp_path_factory, avi) -> Path:
    """Three classes of three videos; in split set N video N is unused (0), video N+1 is
    test (2) and the other is train (1)."""
    root = tmp_path_factory.mktemp("hmdb")
    lists = root / "testTrainMulti_7030_splits"
    lists.mkdir()
    for c in HMDB_CLASSES:
        (root / c).mkdir()
        for k in range(3):
            shutil.copy(avi, root / c / _hmdb_name(c, k))
        for n in (1, 2, 3):
            role = {(n - 1) % 3: 0, n % 3: 2, (n + 1) % 3: 1}
            (lists / f"{c}_test_split{n}.txt").write_text("".join(f"{_hmdb_name(c, k)} {role[k]} \n"
                                                                  for k in range(3)))
    return root


def _by_split(source) -> dict[str, list[tuple[str, str]]]:
    out = {}
    for v in source.videos:
        out.setdefault(v.split, []).append((v.relpath, v.label))
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("split_set", [1, 2, 3])
def test_ucf101_split_sets(ucf101, split_set):
    source = discover(str(ucf101), split_set)
    assert source.layout == f"ucf101-split{split_set}"
    assert source.classes == UCF_CLASSES  # classInd's order
    groups = {"train": [g for g in (1, 2, 3) if g != split_set], "val": [split_set]}
    expected = {split: sorted((f"UCF-101/{_ucf_name(c, g)}", c) for c in UCF_CLASSES for g in gs
                              if (c, g) != ("Archery", 3)) for split, gs in groups.items()}
    assert _by_split(source) == expected
    assert [m.path for m in source.missing] == [f"UCF-101/{_ucf_name('Archery', 3)}"]  # listed, not there


@pytest.mark.parametrize("split_set", [1, 2, 3])
def test_hmdb51_split_sets(hmdb51, split_set):
    source = discover(str(hmdb51), split_set)
    assert source.layout == f"hmdb51-split{split_set}"
    assert source.classes == HMDB_CLASSES
    expected = {"train": sorted((f"{c}/{_hmdb_name(c, (split_set + 1) % 3)}", c) for c in HMDB_CLASSES),
                "val": sorted((f"{c}/{_hmdb_name(c, split_set % 3)}", c) for c in HMDB_CLASSES)}
    assert _by_split(source) == expected


def build_as_the_runbook_says(src: Path, out: Path) -> None:
    """docs/runbooks/ingest-on-ray.md's build on the stand-ins, read from the runbook and run here
    (``ingest``'s own main, on the suite's Ray; recorded as run once it succeeded:
    tests/helpers/runbooks.py)."""
    [line] = block_commands("ingest-on-ray.md", "ingest build --src ucf101",
                            {"--src ucf101": f"--src {src}", "--out shards": f"--out {out}"})
    assert cli.main(shlex.split(line)[1:]) == 0
    ran(line)


@pytest.mark.parametrize("dataset", ["ucf101", "hmdb51"])
def test_build_labels_clips_with_the_official_class_index(ray_local, request, tmp_path, dataset):
    src = request.getfixturevalue(dataset)
    classes = UCF_CLASSES if dataset == "ucf101" else HMDB_CLASSES
    build_as_the_runbook_says(src, tmp_path)
    m = Manifest.load(str(tmp_path))
    assert m.classes == classes and m.config["layout"] == f"{dataset}-split2" and m.motion == "mv"
    assert verify.verify(m, deep=True) == []
    counts = {"ucf101": {"train": 5, "val": 3}, "hmdb51": {"train": 3, "val": 3}}[dataset]
    assert {name: s.num_samples for name, s in m.splits.items()} == counts
    source = discover(str(src), 2)
    expected = {v.video_id: classes.index(v.label) for v in source.videos}
    for split in m.splits.values():
        shard = split.shards[0]
        data = (tmp_path / shard.name).read_bytes()
        for key, label, offset, length in zip(shard.keys, shard.labels, shard.offsets, shard.lengths):
            sample = parse(data[offset:offset + length], key, label=label, motion=m.motion)  # cls agrees
            assert label == expected[key.rsplit("_c", 1)[0]] and sample.frames
