"""shards verify, stats, preview and reshard on real shard sets."""
import json
import os
import shutil

import pytest
from helpers.shardsets import corrupt_sample, frame_colour, jpeg, make_shardset, serve
from PIL import Image

from shards.cli import main
from shards.format.manifest import Manifest, SplitInfo
from shards.format.packing import write_shard
from shards.format.tar import RECORD, sample_bytes
from shards.tools.preview import DAMAGED, GAP, LABEL_WIDTH
from shards.tools.reshard import BadShard, reshard
from shards.tools.stats import collect
from shards.tools.verify import verify

TRAIN, TEST = 23, 7


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pristine"))
    make_shardset(d, {"train": TRAIN, "test": TEST}, per_shard=5)
    return d


@pytest.fixture
def shardset(pristine, tmp_path):
    d = str(tmp_path / "set")
    shutil.copytree(pristine, d)
    return d


def shard_path(d, split="train", k=1):
    m = Manifest.load(d)
    return m, m.splits[split].shards[k], os.path.join(d, m.splits[split].shards[k].name)


def problems(d, **kw):
    m = Manifest.load(d)
    return [str(p) for p in verify(m, frames=m.config["clip"]["frames"], **kw)]


def test_a_good_set_verifies_and_exits_zero(shardset, capsys):
    assert problems(shardset, deep=True) == []
    assert main(["verify", shardset, "--deep"]) == 0
    assert "0 problems" in capsys.readouterr().out


def test_flipped_byte_is_caught(shardset, capsys):
    _, shard, path = shard_path(shardset)
    data = bytearray(open(path, "rb").read())
    data[shard.offsets[2] + 3000] ^= 0x10  # inside a JPEG of the third sample
    open(path, "wb").write(data)
    assert problems(shardset) == [f"{shard.name}: sample {shard.keys[2]}: xxh3-64 digest differs from the "
                                  f"manifest's",
                                  f"{shard.name}: SHA-256 differs from the manifest (content changed)"]
    assert main(["verify", shardset]) == 1
    assert "SHA-256" in capsys.readouterr().out


def test_flipped_byte_in_a_header_names_the_sample(shardset):
    _, shard, path = shard_path(shardset)
    data = bytearray(open(path, "rb").read())
    data[shard.offsets[3] + 2] ^= 0x01  # the first member's name
    open(path, "wb").write(data)
    found = problems(shardset)
    assert any(p.startswith(f"{shard.name}: sample {shard.keys[3]}: ") for p in found)
    assert any("SHA-256" in p for p in found)


def test_truncated_shard_is_caught(shardset):
    _, shard, path = shard_path(shardset, k=2)
    os.truncate(path, shard.offsets[3] + 100)
    found = problems(shardset)
    at = shard.offsets[3] + 100
    assert (f"{shard.name}: sample {shard.keys[3]}: the shard ends at byte {at:,}, inside this sample: "
            f"{shard.bytes - at:,} of the manifest's {shard.bytes:,} bytes missing (a partial copy?); 1 "
            "later samples missing") in found
    assert f"{shard.name}: {shard.offsets[3] + 100} bytes, manifest says {shard.bytes} (truncated)" in found


def test_missing_shard_is_caught(shardset, capsys):
    _, shard, path = shard_path(shardset, "test", 0)
    os.remove(path)
    assert problems(shardset) == [f"{shard.name}: missing"]
    assert main(["verify", shardset, "--split", "train"]) == 0
    assert main(["verify", shardset]) == 1


def test_missing_member_and_undecodable_frame(tmp_path):
    frames = [(f"{t:02d}.jpg", jpeg((t, t, t))) for t in range(8)]
    samples = [("v0_c00", 0, sample_bytes("v0_c00", frames[:3] + frames[4:]
                                          + [("cls", b"0"), ("json", b"{}")])),
               ("v1_c00", 1, sample_bytes("v1_c00", frames[:5] + [("05.jpg", b"\xff\xd8garbage")] + frames[6:]
                                          + [("cls", b"1"), ("json", b"{}")]))]
    d = str(tmp_path)
    info = write_shard(os.path.join(d, "train/train-000000.tar"), "train/train-000000.tar", samples)
    Manifest(classes=["a", "b"], splits={"train": SplitInfo([info])}, config={"clip": {"frames": 8}}).save(d)
    header = ("train/train-000000.tar: sample v1_c00: a frame's bytes are no picture: "
              "its JPEG header does not parse")
    assert problems(d) == ["train/train-000000.tar: sample v0_c00: 7 frames where the set has 8: "
                           "03.jpg missing",
                           header]  # a header is checked without --deep, as every reader checks it
    assert main(["verify", d]) == 1  # frames expected from the manifest's config.clip.frames
    assert problems(d, deep=True)[1] == header


def test_stats_counts_from_manifest_and_probed_clips(pristine, capsys):
    s = collect(Manifest.load(pristine), probe=0)
    train = s["splits"]["train"]
    assert train["clips"] == TRAIN and train["shards"] == 5
    assert train["classes"] == {"class0": 8, "class1": 8, "class2": 7}
    assert s["splits"]["test"]["classes"] == {"(unlabeled)": TEST}
    assert train["frames_per_clip"] == {8: TRAIN} and train["frame_sizes"] == {"64x48": 8 * TRAIN}
    assert train["bytes"] == sum(os.path.getsize(os.path.join(pristine, "train", f))
                                 for f in os.listdir(os.path.join(pristine, "train")))
    assert collect(Manifest.load(pristine), probe=4)["splits"]["train"]["probed_clips"] == 4
    assert main(["stats", pristine, "--json", "--probe", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["splits"]["test"]["probed_clips"] == 3 and out["classes"] == 3
    assert main(["stats", pristine]) == 0
    assert "train: 23 clips in 5 shards" in capsys.readouterr().out


@pytest.mark.parametrize("probe", [0, TRAIN])
def test_stats_checks_every_clip_it_reads_against_its_digest_and_names_the_bad_ones(shardset, probe, capsys):
    """Before: a damaged clip was read unchecked and counted, exit 0 (docs/service.md said stats reads
    through the digest-checked path)."""
    shard = corrupt_sample(shardset, "train", 1, keep_mtime=True)
    key = shard.keys[2]
    assert main(["stats", shardset, "--probe", str(probe)]) == 1
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert line.startswith(f"shards stats: error: 1 clip read is damaged ({shard.name} sample {key}): "
                           f"xxh3-64 digest ")
    assert line.endswith(f", the manifest says {shard.digests[2]}; "
                         f"shards verify {shardset} checks every clip")
    assert "1 of the 23 clips read are damaged (left out of these figures):" in out
    assert (f"    {shard.name}: sample {key}: xxh3-64 digest " in out and f"the manifest says "
            f"{shard.digests[2]}" in out)
    assert "from 23 clips read: 22 clips of 8 frames;" in out  # the damaged clip is in no figure
    assert main(["stats", shardset, "--probe", str(probe), "--json"]) == 1
    (bad,) = json.loads(capsys.readouterr().out)["splits"]["train"]["bad_samples"]
    assert (bad["shard"], bad["key"], bad["expected"]) == (shard.name, key, shard.digests[2]) != bad["found"]


def test_preview_marks_a_damaged_clip_and_exits_1_after_drawing_the_sheet(shardset, tmp_path, capsys):
    """Before: the damaged clip's frames were drawn as a grey block, exit 0."""
    shard = corrupt_sample(shardset, "train", 1, keep_mtime=True)  # clip 7 of the split
    out, page = tmp_path / "sheet.png", tmp_path / "page"
    assert main(["preview", shardset, "--clips", str(TRAIN), "--height", "48", "--out", str(out),
                 "--html", str(page)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"shards preview: error: 1 of the 23 clips shown are damaged and marked so ({shard.name} "
                   f"sample {shard.keys[2]}); shards verify {shardset} checks every clip"]
    sheet = Image.open(out).convert("RGB")
    for row in (6, 7, 8):  # the frames' centres: the clip's colours, and for the damaged clip none of them
        pixels = [sheet.getpixel((LABEL_WIDTH + t * (64 + GAP) + 32, GAP + row * (48 + GAP) + 24))
                  for t in range(8)]
        if row != 7:
            assert all(max(abs(a - b) for a, b in zip(p, frame_colour(row, t))) <= 6 for t,
                       p in enumerate(pixels))
        else:
            assert (len(set(pixels)) == 1 and sheet.getpixel((LABEL_WIDTH + 1, GAP + row * (48 + GAP)
                                                              + 24)) == DAMAGED)
    html = (page / "index.html").read_text()
    assert (f'<tr class="damaged"><th>class1<br><small>{shard.keys[2]}</small></th>'
            f'<td>damaged: xxh3-64 digest ' in html)
    assert f"the manifest says {shard.digests[2]}</td></tr>" in html and html.count("<img") == 8 * (TRAIN - 1)


def sample_table(d):
    m = Manifest.load(d)
    out = {}
    for name, split in m.splits.items():
        rows = []
        for shard in split.shards:
            data = open(os.path.join(d, shard.name), "rb").read()
            rows += [(k, lab, data[o:o + n]) for k, lab, o, n in zip(shard.keys, shard.labels, shard.offsets,
                                                                     shard.lengths)]
        out[name] = rows
    return out


@pytest.mark.parametrize("how", [{"shard_samples": 7}, {"num_shards": 2}, {"shard_bytes": 60_000}])
def test_reshard_keeps_every_sample_and_verifies(pristine, tmp_path, how):
    out = reshard(pristine, str(tmp_path / "new"), **how)
    assert sample_table(str(tmp_path / "new")) == sample_table(pristine)
    assert problems(str(tmp_path / "new"), deep=True) == []
    counts = [s.num_samples for s in out.splits["train"].shards]
    if "num_shards" in how:
        assert counts == [11, 12]
    if "shard_samples" in how:
        assert counts == [7, 7, 7, 2]
    if "shard_bytes" in how:
        # packing.cut counts the two end blocks, not the padding to a whole 10 KiB tar record
        assert len(counts) > 1 and all(s.bytes <= 60_000 + RECORD for s in out.splits["train"].shards)


def test_reshard_is_deterministic_and_round_trips(pristine, tmp_path):
    a, b, back = (str(tmp_path / x) for x in ("a", "b", "back"))
    assert main(["reshard", pristine, a, "--num-shards", "3"]) == 0
    reshard(pristine, b, num_shards=3)
    assert open(os.path.join(a, "manifest.json"),
                "rb").read() == open(os.path.join(b, "manifest.json"), "rb").read()
    reshard(a, back, shard_samples=5)
    shas = lambda d: [s.sha256 for sp in Manifest.load(d).splits.values() for s in sp.shards]  # noqa: E731
    assert shas(back) == shas(pristine)


def test_verify_and_reshard_over_http(pristine, tmp_path):
    with serve(pristine) as (url, requests):
        assert problems(url) == []
        reshard(url, str(tmp_path / "copy"), num_shards=1)
    assert sample_table(str(tmp_path / "copy")) == sample_table(pristine)
    # the manifest, the shards, and the set's class list and ledger, carried over
    assert all(p in ("/manifest.json", "/classes.txt", "/errors.jsonl") or p.endswith(".tar") for _,
               p in requests)


def flip_a_jpeg_byte(d, split="train", k=1):
    # inside a JPEG of the third sample: only the hash sees it
    return corrupt_sample(d, split, k, keep_mtime=False)


def test_reshard_refuses_a_damaged_source_naming_the_shard(shardset, tmp_path, capsys):
    shard = flip_a_jpeg_byte(shardset)
    dst = tmp_path / "new"
    with pytest.raises(BadShard, match=f"^{shard.name}: sample {shard.keys[2]}: xxh3-64 digest differs"):
        reshard(shardset, str(dst), shard_samples=7)
    assert [p for p in dst.rglob("*") if p.is_file()] == []  # shards written before it are removed
    assert main(["reshard", shardset, str(dst), "--num-shards", "2"]) == 1
    assert f"error: {shard.name}: sample {shard.keys[2]}: xxh3-64 digest differs" in capsys.readouterr().err


def test_reshard_refuses_a_sample_under_another_key(shardset, tmp_path):
    m = Manifest.load(shardset)
    shard = m.splits["test"].shards[0]
    shard.keys[1] = "intruder"  # the bytes are intact, the manifest's key for them is not
    m.save(shardset)
    with pytest.raises(BadShard, match=f"^{shard.name}: sample intruder: member .* does not belong to it"):
        reshard(shardset, str(tmp_path / "new"), num_shards=1)


def test_reshard_skip_bad_leaves_damaged_shards_out_and_reports_the_clips_lost(
        pristine, shardset, tmp_path, capsys):
    shard = flip_a_jpeg_byte(shardset)
    dst = str(tmp_path / "new")
    assert main(["reshard", shardset, dst, "--shard-samples", "7", "--skip-bad"]) == 0
    out = capsys.readouterr().out
    assert f"skipped damaged {shard.name}: {shard.num_samples} clips lost" in out
    assert f"{shard.num_samples} clips lost in 1 damaged shard\n" in out  # before: "1 damaged shards"
    lost = set(shard.keys)
    expected = {split: [row for row in rows if row[0] not in lost] for split,
                rows in sample_table(pristine).items()}
    assert sample_table(dst) == expected and len(expected["train"]) == TRAIN - shard.num_samples
    assert problems(dst, deep=True) == []
    m = Manifest.load(dst)
    assert m.splits["train"].num_failed == shard.num_samples
    assert m.config["resharded"]["dropped"] == {shard.name: shard.num_samples}
