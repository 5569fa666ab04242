"""Damaged and hostile copies of one sound shard set, each given to ``shards verify``, ``shards stats``
and ``trainer train`` as a user runs them (console scripts, subprocesses, all at once): every one ends
with exit status 1 (damaged data) or 2 (a path or option), with no traceback, in one line naming the
file and the reason (verify's problems are its stdout; the others' refusal one ``error:`` line).

Each case is a copy of the set with one thing changed (issue 37's list): a shard cut short, a tar
member header claiming 1 GiB, a symlink member in place of a frame, a sample range running into the
archive's zero padding (the manifest's digests and SHA-256 written to agree, as a tool that rewrote
the set would), and manifests that are not what the builder writes. ``trainer train`` meets every
damage to the bytes and one manifest refusal of each kind in the suite, the other manifest cases in
the long stage (``TRAIN_IN_THE_SUITE``: each is a torch process start, and the manifest's check is
the one that verify and stats show in the suite for every case).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.shardsets import make_shardset

from shards.format.digests import sample_digest

BIN = os.path.dirname(sys.executable)  # the console scripts beside this Python
ANSWER_S = 300
TRAIN = ("trainer train --data {set} --output-dir {set}/run --backend none --depth 10 --width 8 --crop-size "
         "32 --scale-size 36 --workers 0 --epochs 1 --batch-size 2")
COMMANDS = {"verify": "shards verify {set}", "stats": "shards stats {set} --probe 0", "train": TRAIN}


def _manifest(d: str) -> dict:
    with open(os.path.join(d, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def _write_manifest(d: str, m) -> None:
    with open(os.path.join(d, "manifest.json"), "w", encoding="utf-8") as f:
        f.write(m if isinstance(m, str) else json.dumps(m))


def _edit(change):
    """A manifest case: ``change(manifest dict)`` edits the first shard (or returns the new text)."""
    def mutate(d: str) -> None:
        m = _manifest(d)
        out = change(m, m["splits"]["train"]["shards"][0])
        _write_manifest(d, m if out is None else out)
    return mutate


def _rewrite_shard(d: str, change) -> None:
    """``change(bytearray of shard 0, its manifest entry)`` edits the shard's bytes in place; the
    manifest's digests, SHA-256 and size are then written to agree with them."""
    m = _manifest(d)
    shard = m["splits"]["train"]["shards"][0]
    path = os.path.join(d, shard["name"])
    with open(path, "rb") as f:
        data = bytearray(f.read())
    change(data, shard)
    with open(path, "wb") as f:
        f.write(data)
    shard["digests"] = [sample_digest(bytes(data[o:o + n])) for o,
                        n in zip(shard["offsets"], shard["lengths"])]
    shard["sha256"], shard["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    _write_manifest(d, m)


def _header(data: bytearray, at: int, **fields) -> None:
    """The tar header at byte ``at`` rewritten with ``fields`` (size, type), its checksum made right."""
    info = tarfile.TarInfo.frombuf(bytes(data[at:at + 512]), "utf-8", "strict")
    for k, v in fields.items():
        setattr(info, k, v)
    block = info.tobuf(tarfile.GNU_FORMAT, "utf-8", "strict")
    data[at:at + 512] = block[-512:]


def _truncate(d: str) -> None:
    shard = _manifest(d)["splits"]["train"]["shards"][0]
    os.truncate(os.path.join(d, shard["name"]), shard["offsets"][2] + 1000)


def _huge_member(data: bytearray, shard: dict) -> None:
    _header(data, shard["offsets"][2], size=1 << 30)


def _symlink_frame(data: bytearray, shard: dict) -> None:
    at = shard["offsets"][2]
    for _ in range(3):  # the fourth member: frame 03
        info = tarfile.TarInfo.frombuf(bytes(data[at:at + 512]), "utf-8", "strict")
        at += 512 + -(-info.size // 512) * 512
    _header(data, at, type=tarfile.SYMTYPE, linkname="/etc/passwd", size=0)


def _into_padding(data: bytearray, shard: dict) -> None:
    shard["lengths"][-1] += 1024  # the archive's end: two zero blocks, then zero padding


def _path(name: str):
    return _edit(lambda m, s: s.update(name=name))


CASES = {  # case -> (what it does to a copy of the set, words each answer names)
    "truncated-shard": (_truncate, ["train/train-00000", "a partial copy?"]),
    "member-claims-1GiB": (lambda d: _rewrite_shard(d, _huge_member), ["claims 1,073,741,824 bytes"]),
    "symlink-frame": (lambda d: _rewrite_shard(d, _symlink_frame), ["symbolic link"]),
    "range-into-padding": (lambda d: _rewrite_shard(d, _into_padding), ["zero block"]),
    "empty-manifest": (lambda d: _write_manifest(d, ""), ["manifest.json"]),
    "not-json": (lambda d: _write_manifest(d, "{not json"), ["manifest.json"]),
    "json-array": (lambda d: _write_manifest(d, "[]"), ["manifest.json", "not a JSON object"]),
    "deep-nesting": (lambda d: _write_manifest(d, "[" * 100_000 + "]" * 100_000), ["manifest.json"]),
    "format-evil": (_edit(lambda m, s: m.update(format="evil/9")), ["manifest.json", "evil/9"]),
    "missing-field": (_edit(lambda m, s: s.__delitem__("sha256")), ["manifest.json", "sha256", "missing"]),
    "extra-field": (_edit(lambda m, s: s.update(extra=1)), ["manifest.json", "extra"]),
    "wrong-type": (_edit(lambda m, s: s.update(bytes="12")), ["manifest.json", "bytes"]),
    "offsets-null": (_edit(lambda m, s: s.update(offsets=None)), ["manifest.json", "offsets"]),
    "num-samples-string": (_edit(lambda m, s: s.update(num_samples="3")), ["manifest.json", "num_samples"]),
    "length-1e12": (_edit(lambda m, s: s["lengths"].__setitem__(0, 10 ** 12)),
                    ["manifest.json", "lengths[0]"]),
    "offset-2**70": (_edit(lambda m, s: s["offsets"].__setitem__(1, 2 ** 70)), ["manifest.json", "offsets"]),
    "offset-negative": (_edit(lambda m, s: s["offsets"].__setitem__(1, -512)), ["manifest.json", "offsets"]),
    "num-samples-1e12": (_edit(lambda m, s: s.update(num_samples=10 ** 12)),
                         ["manifest.json", "num_samples"]),
    "name-outside-the-set": (_path("../../other-set/train/train-000000.tar"),
                             ["manifest.json", "inside the set"]),
    "name-absolute": (_path("/etc/passwd"), ["manifest.json", "inside the set"]),
    "name-http": (_path("http://example.invalid/train-000000.tar"), ["manifest.json", "inside the set"]),
    "name-file-url": (_path("file:///etc/passwd"), ["manifest.json", "inside the set"]),
    "label-999": (_edit(lambda m, s: s["labels"].__setitem__(0, 999)), ["manifest.json", "labels"]),
    "label-minus-5": (_edit(lambda m, s: s["labels"].__setitem__(0, -5)), ["manifest.json", "labels"]),
    "classes-string": (_edit(lambda m, s: m.update(classes="abc")), ["manifest.json", "classes"]),
}


def _run(line: str, d: str) -> subprocess.CompletedProcess:
    argv = [a.format(set=d) for a in line.split()]
    try:
        return subprocess.run([os.path.join(BIN, argv[0]), *argv[1:]], capture_output=True, text=True,
                              timeout=ANSWER_S)
    except subprocess.TimeoutExpired as e:  # a command that never answers fails its case alone
        return subprocess.CompletedProcess(e.cmd, None, e.stdout or "", f"no answer in {e.timeout} s")


# The cases `trainer train` meets in the suite: every damage to a shard's bytes, and one of each kind
# of manifest refusal (every manifest is checked by the same code as it is loaded, which verify and
# stats show for every case); the trainer's answer to each of the others is the long stage's.
TRAIN_IN_THE_SUITE = {"truncated-shard", "member-claims-1GiB", "symlink-frame", "range-into-padding",
                      "empty-manifest", "name-outside-the-set", "num-samples-1e12"}


def _answers(root, jobs: list[tuple[str, str]]) -> dict:
    """Each job's copy made, and its command run on it, all at once; -> {(case, command):
    CompletedProcess}."""
    sound = str(root / "sound")
    make_shardset(sound, {"train": 10, "val": 4}, per_shard=5, unlabeled=())
    copies = {}
    for case in {case for case, _ in jobs}:
        copies[case] = str(root / case)
        shutil.copytree(sound, copies[case])
        CASES[case][0](copies[case])
    with ThreadPoolExecutor(4) as pool:
        done = pool.map(lambda job: _run(COMMANDS[job[1]], copies[job[0]]), jobs)
        return dict(zip(jobs, done))


def _in_the_suite(case: str, command: str) -> bool:
    return command != "train" or case in TRAIN_IN_THE_SUITE


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    return _answers(tmp_path_factory.mktemp("hostile"),
                    [(case, command) for case in CASES for command in COMMANDS
                     if _in_the_suite(case, command)])


@pytest.fixture(scope="module")
def long_answers(tmp_path_factory):
    return _answers(tmp_path_factory.mktemp("hostile-long"),
                    [(case, command) for case in CASES for command in COMMANDS
                     if not _in_the_suite(case, command)])


@pytest.mark.parametrize("case, command", [
    pytest.param(case, command, id=f"{case}-{command}",
                 marks=() if _in_the_suite(case, command) else pytest.mark.long)
    for case in CASES for command in COMMANDS])
def test_a_damaged_or_hostile_set_is_answered_in_one_line(request, case, command):
    answers = request.getfixturevalue("answers" if _in_the_suite(case, command) else "long_answers")
    p, words = answers[case, command], CASES[case][1]
    assert "Traceback" not in p.stdout + p.stderr, p.stderr[-3000:]
    assert p.returncode in (1, 2), (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    errors = [line for line in p.stderr.splitlines() if ": error: " in line]
    if command == "verify" and not errors:  # damaged data: verify's problems, on its stdout
        said = [line for line in p.stdout.splitlines() if all(w in line for w in words)]
        assert said, p.stdout
    else:
        assert len(errors) == 1, p.stderr[-3000:]
        assert all(w in errors[0] for w in words), errors[0]
