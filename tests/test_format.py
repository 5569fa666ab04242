"""The format's two gates, in-process: ``shards.format.sample.parse`` on hand-made tar bytes, and
``shards.format.checks`` on hand-edited manifests of a real small set. Each refusal is one line
naming the place and the reason; each sound input passes unchanged."""
from __future__ import annotations

import json
import tarfile

import pytest
from helpers.shardsets import jpeg, make_shardset, uniform_field

from shards.format import sample
from shards.format.checks import MAX_SAMPLE_BYTES, BadManifest
from shards.format.manifest import Manifest
from shards.format.sample import BadSample
from shards.format.tar import BLOCK, member_bytes

FRAMES = [jpeg((10 * t, 0, 0)) for t in range(4)]


def packed(label=2, motion="none") -> bytes:
    fields = [uniform_field(1, 0) for _ in FRAMES] if motion != "none" else []
    return sample.pack("v0_c00", FRAMES, label, {"video": "v0"}, fields, motion)


def test_a_packed_sample_parses_back_to_its_members():
    s = sample.parse(packed(), "v0_c00", label=2, frames=4, where="x.tar")
    assert [bytes(f) for f in s.frames] == FRAMES and s.label == 2 and s.meta() == {"video": "v0"}
    data = packed()
    assert [bytes(data[o:o + n]) for o, n in s.spans] == FRAMES  # spans index the sample's own bytes
    with_motion = sample.parse(packed(motion="flow"), "v0_c00", label=2, frames=4, motion="flow")
    assert len(with_motion.fields) == 4 and bytes(with_motion.fields[0]) == uniform_field(1, 0)


def member(name: str, data: bytes, kind=tarfile.REGTYPE, size: int | None = None, link: str = "") -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname = len(data) if size is None else size, kind, link
    return info.tobuf(format=tarfile.GNU_FORMAT) + data + b"\0" * (-len(data) % BLOCK)


def frames_then(*extra: bytes, frames=FRAMES[:3]) -> bytes:
    return b"".join(member_bytes(f"k.{t:02d}.jpg", f) for t, f in enumerate(frames)) + b"".join(extra)


META = member_bytes("k.json", b"{}")
CASES = [  # (id, sample bytes, words of the refusal)
    ("header-claims-a-gigabyte", frames_then(member("k.json", b"{}", size=1 << 30)),
     ["claims 1,073,741,824 bytes"]),
    ("symlink-for-a-frame", frames_then(member("k.03.jpg", b"", tarfile.SYMTYPE, link="/etc/passwd"), META,
                                        frames=FRAMES[:3]), ["k.03.jpg", "symbolic link",
                                                             "regular files only"]),
    ("hard-link", frames_then(member("k.03.jpg", b"", tarfile.LNKTYPE, link="k.00.jpg"), META),
     ["hard link"]),
    ("directory", frames_then(member("k.dir", b"", tarfile.DIRTYPE), META), ["directory"]),
    ("another-samples-member", frames_then(member_bytes("other.03.jpg", FRAMES[3]), META),
     ["other.03.jpg", "does not belong"]),
    ("dot-dot-name", frames_then(member_bytes("../k.03.jpg", FRAMES[3]), META), ["does not belong"]),
    ("unknown-suffix", frames_then(member_bytes("k.03.exe", b"MZ"), META),
     ["'03.exe'", "not a member the format"]),
    ("motion-of-another-kind", frames_then(member_bytes("k.00.mv.png", b"x"), META), ["'00.mv.png'"]),
    ("twice", frames_then(member_bytes("k.02.jpg", FRAMES[2]), META), ["k.02.jpg", "appears twice"]),
    ("a-frame-missing", frames_then(META), ["3 frames where the set has 4", "03.jpg missing"]),
    ("no-meta", frames_then(member_bytes("k.03.jpg", FRAMES[3])), ["k.json missing"]),
    ("zero-padding-in-range", frames_then(member_bytes("k.03.jpg", FRAMES[3]), META, b"\0" * 1024),
     ["zero block", "archive's end"]),
    ("ends-inside-a-header", frames_then(member_bytes("k.03.jpg", FRAMES[3]), META[:300]),
     ["ends inside a tar header"]),
    ("garbage-header", frames_then(member_bytes("k.03.jpg", FRAMES[3]), b"\xff" * BLOCK),
     ["no valid tar header"]),
]


@pytest.mark.parametrize("data,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_sample_outside_the_schema_is_one_line_naming_it(data, words):
    with pytest.raises(BadSample) as e:
        sample.parse(data, "k", frames=4, where="train/train-000000.tar")
    line = str(e.value)
    assert line.startswith("train/train-000000.tar: sample k: ") and "\n" not in line
    assert all(w in line for w in words), line


def test_labels_must_agree_with_the_manifest():
    with pytest.raises(BadSample, match="k.cls says '7', the manifest 2"):
        sample.parse(frames_then(member_bytes("k.03.jpg", FRAMES[3]), member_bytes("k.cls", b"7"), META), "k",
                     label=2, frames=4)
    with pytest.raises(BadSample, match="unlabelled"):
        sample.parse(packed(label=2), "v0_c00", label=-1, frames=4)


def test_meta_that_is_not_a_small_json_object_is_refused():
    for body, words in ((b"[1]", "a JSON list"), (b"{", "not JSON"), (b"[" * 100_000, "not JSON"),
                        (b"\xff", "not JSON")):
        with pytest.raises(BadSample, match=words):
            sample.parse_meta(body, "x.tar", "k")


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    root = tmp_path_factory.mktemp("sound")
    make_shardset(str(root), {"train": 6, "val": 3}, per_shard=3, frames=4)
    return json.loads((root / "manifest.json").read_bytes())


def edited(d, path: str, value):
    """A copy of manifest ``d`` with the field at dotted ``path`` set to ``value`` (``DELETE``: removed)."""
    d = json.loads(json.dumps(d))
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is DELETE:
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return json.dumps(d).encode()


DELETE = object()
SHARD = "splits.train.shards.0"
MANIFESTS = [  # (id, how the sound manifest is edited, words of the refusal)
    ("format-unknown", ("format", "evil/9"), ["format: 'evil/9'", "kinetics-fast-shards/2"]),
    ("format-missing", ("format", DELETE), ["format: missing"]),
    ("field-missing", (f"{SHARD}.sha256", DELETE), ["splits.train.shards[0]: field 'sha256' missing"]),
    ("field-extra", (f"{SHARD}.owner", "eve"), ["unknown field 'owner'"]),
    ("offsets-null", (f"{SHARD}.offsets", None), ["splits.train.shards[0].offsets: is null, not a list"]),
    ("num-samples-text", (f"{SHARD}.num_samples", "3"), ["num_samples: is a string, not a number"]),
    ("num-samples-huge", (f"{SHARD}.num_samples", 10**12), ["num_samples", "1,000,000,000,000"]),
    ("num-samples-other", (f"{SHARD}.num_samples", 2), ["3 entries for 2 samples"]),
    ("length-huge", (f"{SHARD}.lengths.0", 10**12), ["lengths[0]: 1,000,000,000,000",
                                                     "above the largest sample"]),
    ("length-beyond-64-bits", (f"{SHARD}.lengths.0", 2**64), ["lengths[0]", "not a whole number in range"]),
    ("length-past-the-shard", (f"{SHARD}.lengths.2", MAX_SAMPLE_BYTES), ["lengths[2]", "beyond the shard"]),
    ("offset-huge", (f"{SHARD}.offsets.1", 2**70), ["offsets[1]", "not a whole number in range"]),
    ("offset-negative", (f"{SHARD}.offsets.0", -512), ["offsets[0]", "is below 0"]),
    ("offset-unaligned", (f"{SHARD}.offsets.1", 1000), ["offsets[1]", "multiple of the tar block"]),
    ("overlapping", (f"{SHARD}.offsets.1", 0), ["offsets[1]", "overlapping"]),
    ("name-up-and-out", (f"{SHARD}.name", "../../other-set/train/train-000000.tar"),
     ["not a path inside the set"]),
    ("name-absolute", (f"{SHARD}.name", "/etc/passwd"), ["'/etc/passwd' is not a path inside the set"]),
    ("name-url", (f"{SHARD}.name", "http://127.0.0.1:9/x.tar"), ["not a path inside the set"]),
    ("name-file-url", (f"{SHARD}.name", "file:///etc/passwd"), ["not a path inside the set"]),
    ("name-backslash", (f"{SHARD}.name", "..\\..\\x.tar"), ["not a path inside the set"]),
    ("name-escaped", (f"{SHARD}.name", "%2e%2e/x.tar"), ["not a path inside the set"]),
    ("name-twice", (f"{SHARD}.name", "train/train-000001.tar"), ["listed twice"]),
    ("label-999", (f"{SHARD}.labels.0", 999), ["labels[0]: 999 is not -1", "3 classes"]),
    ("label-minus-5", (f"{SHARD}.labels.0", -5), ["labels[0]: -5"]),
    ("classes-text", ("classes", "abc"), ["classes: is a string, not a list"]),
    ("classes-twice", ("classes", ["a", "a", "b"]), ["class 'a' is listed twice"]),
    ("key-with-a-dot", (f"{SHARD}.keys.0", "a.b"), ["keys[0]", "not a sample key"]),
    ("digest-not-hex", (f"{SHARD}.digests.0", "zz"), ["digests[0]", "16 lowercase hex"]),
    ("split-name-path", ("splits", {"../x": {"shards": []}}), ["split name '../x'"]),
    ("frames-in-config", ("config.clip.frames", 10**9), ["config.clip.frames"]),
    ("motion-in-config", ("config.clip.motion", "evil"), ["config.clip.motion: 'evil'"]),
]


@pytest.mark.parametrize("edit,words", [c[1:] for c in MANIFESTS], ids=[c[0] for c in MANIFESTS])
def test_a_manifest_outside_the_format_is_one_line_naming_the_field(sound, edit, words):
    with pytest.raises(BadManifest) as e:
        Manifest.from_json(edited(sound, *edit), base="/sets/k400")
    line = str(e.value)
    assert line.startswith("/sets/k400/manifest.json: ") and "\n" not in line
    assert all(w in line for w in words), line


@pytest.mark.parametrize("data,words", [
    (b"", ["empty file"]), (b"not json", ["not JSON"]), (b"[1, 2]", ["a list, not a JSON object"]),
    (b"[" * 100_000 + b"]" * 100_000, ["nested too deeply"]), (b'{"a": "\xff"}',
                                                               ["not UTF-8 JSON", "byte 7"])])
def test_a_file_that_is_no_manifest_is_one_line(data, words):
    with pytest.raises(BadManifest) as e:
        Manifest.from_json(data, base="/sets/k400")
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_sound_manifest_and_an_unlabelled_one_load(sound):
    m = Manifest.from_json(json.dumps(sound).encode(), base="/sets/k400")
    assert m.splits["train"].num_samples == 6
    unlabelled = json.loads(edited(sound, "classes", []))
    for split in unlabelled["splits"].values():
        for shard in split["shards"]:
            shard["labels"] = [-1] * shard["num_samples"]
    assert Manifest.from_json(json.dumps(unlabelled).encode()).classes == []
