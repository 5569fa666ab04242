"""Bad and unusual inputs: every failure is one ledger line, every good video reaches the shards."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import media
from PIL import Image
from test_ingest import samples, tree_bytes

from ingest.build import build
from ingest.clips import ClipConfig
from shards.format.manifest import Manifest

pytestmark = pytest.mark.usefixtures("ray_local")

BROKEN = {  # file name -> (factory, start of the ledger reason)
    "zero.mp4": (media.make_zero_byte, "empty file"),
    "cut_mdat.mp4": (lambda p: media.make_truncated(p, faststart=True), "truncated or corrupt"),
    "cut_moov.mp4": (lambda p: media.make_truncated(p, faststart=False), "not a readable video"),
    "text.mp4": (media.make_not_a_video, "not a readable video"),
    "audio.mp4": (media.make_audio_only, "no video stream"),
    "dangling.mp4": (media.make_unreadable, "not a regular file"),
    "folder.mp4": (media.make_directory_named_like_video, "is a directory"),
    "pipe.mp4": (media.make_named_pipe, "not a regular file"),  # never opened: it would block
}
UNLABELED = {  # training videos without a label: ledger lines, never samples
    "train/loose.mp4": "unlabeled: not inside a class folder",
}
GOOD = {  # file name -> factory; each must produce a clip of exactly the right frames
    "plain.mp4": lambda p: media.make_video(p, frames=24),
    "few.mp4": media.make_few_frames,
    "big.mp4": media.make_high_res,
    "vp9.webm": media.make_vp9_webm,
    "hevc.mp4": media.make_hevc_mp4,
    "divx.avi": media.make_mpeg4_avi,
    "h264.mkv": media.make_mkv,
    "full_chroma.mp4": media.make_yuv444,
    "vfr.mp4": media.make_vfr,
    "rotated.mp4": media.make_rotated,
    "rotated180.mp4": lambda p: media.make_rotated(p, degrees=180),
    "rotated270.mp4": lambda p: media.make_rotated(p, degrees=270),
    "anamorphic.mp4": media.make_anamorphic,
    "edit_list.mp4": media.make_edit_list,  # 48 frames listed, 35 shown: frame 0 is the 13th encoded
}
FIRST_SHOWN = {"edit_list": 13}
# Where the red marker of the first frame's top-left corner must be once the display matrix's
# rotation is applied, and whether the frame is then portrait: together they tell every turn and
# mirror apart (a mirrored 90-degree turn puts the marker in another corner; a plain mirror keeps
# the frame landscape).
ORIENTATION = {"plain": ("top-left", False), "rotated": ("top-right", True),
               "rotated180": ("bottom-right", False), "rotated270": ("bottom-left", True)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    src = tmp_path_factory.mktemp("inputs")
    for name, (make, _) in BROKEN.items():
        make(src / "val" / "broken" / name)
    for name, make in GOOD.items():
        make(src / "val" / "good" / name)
    for relpath in UNLABELED:
        media.make_video(src / relpath)
    media.make_video(src / "train" / "good" / "labeled.mp4")
    out = tmp_path_factory.mktemp("out")
    summary = build(str(src), str(out), ClipConfig(short_side=32), workers=2, shard_samples=50,
                    videos_per_task=3)
    return src, out, summary


def test_every_broken_input_is_one_ledger_line(built):
    src, out, summary = built
    ledger = [json.loads(l) for l in (out / "errors.jsonl").read_text().splitlines()]
    warned = [(e["path"], e["warning"]) for e in ledger if "warning" in e]
    assert warned == [("val/good/big.mp4", "few frames"), ("val/good/few.mp4", "few frames")]
    ledger = [e for e in ledger if "warning" not in e]
    assert sorted(e["path"] for e in ledger) == sorted([f"val/broken/{n}" for n in BROKEN] + list(UNLABELED))
    for e in ledger:
        expected = UNLABELED.get(e["path"]) or BROKEN[e["path"].rsplit("/", 1)[1]][1]
        assert e["reason"].startswith(expected), e
    assert "moov atom not found" in next(e for e in ledger if e["path"].endswith("text.mp4"))["ffmpeg"]
    assert summary.failed == len(BROKEN) + len(UNLABELED)
    assert summary.videos == len(BROKEN) + len(GOOD) + len(UNLABELED) + 1


def test_unlabeled_training_videos_never_reach_the_shards(built):
    _, out, _ = built
    assert sorted(samples(out, "train")) == ["labeled_c00"]
    m = Manifest.load(str(out))
    assert all(label >= 0 for shard in m.splits["train"].shards for label in shard.labels)
    assert m.splits["train"].num_failed == len(UNLABELED)


@pytest.fixture(scope="module")
def built_with_ffmpeg(built, tmp_path_factory):
    """The same turned videos built again through the ffmpeg command line (``--decoder ffmpeg``)."""
    src = tmp_path_factory.mktemp("turned")
    (src / "val" / "good").mkdir(parents=True)
    for name in ORIENTATION:
        shutil.copy(built[0] / "val" / "good" / f"{name}.mp4", src / "val" / "good")
    out = tmp_path_factory.mktemp("out-ffmpeg")
    build(str(src), str(out), ClipConfig(short_side=32, decoder="ffmpeg"), workers=2, shard_samples=50)
    return out


@pytest.mark.parametrize("decoder", ["pyav", "ffmpeg"])
def test_rotated_frames_come_out_the_right_way_up(request, decoder):
    if decoder == "pyav":
        out = request.getfixturevalue("built")[1]
    else:
        out = request.getfixturevalue("built_with_ffmpeg")
    got = samples(out, "val")
    for name, (corner, portrait) in ORIENTATION.items():
        assert json.loads(got[f"{name}_c00"]["json"])["decoder"] == decoder
        frames = [np.asarray(Image.open(io.BytesIO(got[f"{name}_c00"][f"{t:02d}.jpg"]))) for t in range(8)]
        assert [(media.marker_corner(f), f.shape[0] > f.shape[1])
                for f in frames] == [(corner, portrait)] * 8, name


def test_every_good_input_gives_its_exact_frames(built):
    src, out, _ = built
    got = samples(out, "val")
    assert sorted(got) == sorted(n.split(".")[0] + "_c00" for n in GOOD)
    for key, members in got.items():
        meta = json.loads(members["json"])
        n = meta["num_frames"]
        assert meta["frame_indices"] == [min(n - 1, int(n / 16 + n / 8 * i)) for i in range(8)]
        imgs = [np.asarray(Image.open(io.BytesIO(members[f"{t:02d}.jpg"]))) for t in range(8)]
        shift = FIRST_SHOWN.get(key[:-4], 0)
        assert [media.frame_index_from_image(i) for i in imgs] == [(f + shift) % media.PERIOD
                                                                   for f in meta["frame_indices"]], key
        assert min(imgs[0].shape[:2]) == 32 and list(imgs[0].shape[1::-1]) == meta["frame_size"]


def test_hard_inputs_are_described_in_metadata(built):
    got = {k: json.loads(v["json"]) for k, v in samples(built[1], "val").items()}
    assert got["few_c00"]["repeated_frames"] and got["few_c00"]["num_frames"] < 8
    assert not got["plain_c00"]["repeated_frames"]
    rot = got["rotated_c00"]
    assert rot["rotation"] in (90, 270) and rot["height"] > rot["width"]  # portrait after rotation
    ana = got["anamorphic_c00"]
    plain = got["plain_c00"]["frame_size"]
    assert ana["frame_size"][0] / ana["frame_size"][1] == pytest.approx(2 * plain[0] / plain[1], rel=0.05)
    assert got["vp9_c00"]["codec"] == "vp9" and got["hevc_c00"]["codec"] == "hevc"
    assert got["edit_list_c00"]["num_frames"] == 35
    assert {m["decoder"] for m in got.values()} == {"pyav"}


def test_without_ray_every_bad_input_is_the_same_ledger_line_and_the_set_the_same_bytes(built, tmp_path):
    """The same inputs built in local worker processes (``ingest.tasks.runtime``: a build this small
    without a running Ray): every broken input is the ledger line it is on Ray, the good ones the
    same clips; the whole set (shards, manifest, ledger) is the Ray build's byte for byte."""
    src, out, summary = built
    assert "local" not in summary.tasks_per_node  # the fixture's build ran on Ray
    local = build(str(src), str(tmp_path), ClipConfig(short_side=32), workers=2, shard_samples=50,
                  runner="local")
    assert set(local.tasks_per_node) == {"local"} and local.failed == summary.failed
    assert tree_bytes(tmp_path) == tree_bytes(out)


@pytest.mark.parametrize("runner", ["ray", "local"])
def test_cli_exit_status_follows_max_error_fraction(built, tmp_path, request, runner):
    """On the Ray of --address, and without one (a build this small runs in local worker processes)."""
    src, _, _ = built
    base = [sys.executable, "-m", "ingest", "build", "--src", str(src), "--short-side", "32"]
    if runner == "ray":
        base += ["--address", request.getfixturevalue("ray_local").get_runtime_context().gcs_address]
    strict = subprocess.run(base + ["--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert strict.returncode == 1 and "--max-error-fraction" in strict.stderr  # the error line
    # before: the line did not say that the set was written whole and usable, nor how to accept it
    assert (f"; the set at {tmp_path / 'a'} holds every other video's clips and is usable: the same command "
            "with --max-error-fraction 0.38 accepts it, decoding nothing again") in strict.stderr
    accepted = subprocess.run(base + ["--out", str(tmp_path / "a"), "--max-error-fraction", "0.38"],
                              capture_output=True, text=True)
    assert accepted.returncode == 0 and accepted.stdout.startswith("up to date: "), accepted.stderr
    lenient = subprocess.run(base + ["--out", str(tmp_path / "b"), "--max-error-fraction", "0.5"],
                             capture_output=True, text=True)
    assert lenient.returncode == 0, lenient.stderr
    assert f"{len(BROKEN) + len(UNLABELED)} failed" in lenient.stdout
    assert ("on this machine, without Ray" in lenient.stderr) == (runner == "local")


def test_help_documents_the_error_threshold():
    out = subprocess.run([sys.executable, "-m", "ingest", "build", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--max-error-fraction" in out.stdout and "0.05" in out.stdout


HOSTILE = "bad\x1b[2J\n22:00:00 ingest.build: done: all good.mp4"  # clears a terminal, forges a log line
CAVEATS = {  # file name -> (factory, the ledger warnings of its video under --motion mv --short-side 32)
    "plain.mp4": (lambda p: media.make_video(p, frames=12), []),
    "few.mp4": (media.make_few_frames, ["few frames"]),
    "one_frame.mp4": (lambda p: media.make_video(p, frames=1), ["still image"]),
    "picture.mp4": (lambda p: Image.new("RGB", (64, 48), "red").save(p, format="PNG"),  # a PNG renamed
                    ["no motion vectors", "still image"]),
    "small.mp4": (lambda p: media.make_video(p, frames=12, width=40, height=24), ["small"]),
    "vp9.webm": (media.make_vp9_webm, ["no motion vectors"]),
    "hevc.mp4": (media.make_hevc_mp4, ["no motion vectors"]),
}


def _ingest(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "ingest"), "build", *argv],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def caveats(tmp_path_factory):
    """Videos that are not what they claim, a failing file named to attack the terminal, and a link
    to a file outside the tree, built by the command a user types."""
    src = tmp_path_factory.mktemp("caveats")
    (src / "val" / "a").mkdir(parents=True)
    for name, (make, _) in CAVEATS.items():
        make(src / "val" / "a" / name)
    media.make_not_a_video(src / "val" / "a" / HOSTILE)
    os.symlink("/etc/passwd", src / "val" / "a" / "passwd.mp4")
    out = tmp_path_factory.mktemp("out") / "set"
    return src, out, _ingest("--src", str(src), "--out", str(out), "--short-side", "32", "--motion", "mv",
                             "--max-error-fraction", "0.5")


def test_videos_that_are_not_what_they_claim_are_warnings_counted_in_the_summary_manifest_and_stats(caveats):
    """Before: a PNG renamed .mp4 and a 1-frame video became clips of 8 copies of a frame, VP9 and HEVC
    stored all-unknown motion fields, a 40x24 video was upscaled: all silently."""
    src, out, p = caveats
    assert p.returncode == 0, p.stderr
    ledger = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    warned = {}
    for line in ledger:
        if "warning" in line:
            warned.setdefault(line["path"].rsplit("/", 1)[1], []).append(line["warning"])
    assert warned == {name: codes for name, (_, codes) in CAVEATS.items() if codes}
    reasons = {(line["path"], line.get("warning")): line["reason"] for line in ledger}
    assert reasons[("val/a/vp9.webm", "no motion vectors")].startswith("the vp9 decoder exports none")
    assert "--motion flow" in reasons[("val/a/vp9.webm", "no motion vectors")]
    assert reasons[("val/a/small.mp4", "small")] == ("40x24, smaller than --short-side 32: stored at its own "
                                                     "size, not upscaled")
    assert reasons[("val/a/passwd.mp4", None)] == "not a readable video"  # the link followed: a true reason
    assert ("warnings: 3 x no motion vectors, 2 x still image, 1 x few frames, 1 x small "
            f"(each listed in {out / 'errors.jsonl'})") in p.stdout
    small = {k: json.loads(v["json"]) for k, v in samples(out, "val").items()}["small_c00"]
    assert small["frame_size"] == [40, 24]  # its own size
    expected = {"few frames": 1, "no motion vectors": 3, "small": 1, "still image": 2}
    assert json.loads((out / "manifest.json").read_text())["splits"]["val"]["warnings"] == expected
    stats = subprocess.run([os.path.join(os.path.dirname(sys.executable), "shards"), "stats", str(out)],
                           capture_output=True, text=True, check=True).stdout
    assert ("2 failed at ingest, warnings: 3 x no motion vectors, 2 x still image, 1 x few frames, "
            "1 x small") in stats


def test_untrusted_names_are_printed_escaped(caveats):
    """Before: the name cleared the terminal (ESC [2J) and its line break forged a log line."""
    _, out, p = caveats
    assert "\x1b" not in p.stdout + p.stderr
    lines = (p.stdout + p.stderr).splitlines()
    assert not [line for line in lines if line.startswith("22:00:00 ingest.build: done")]
    assert "failed: val/a/bad\\x1b[2J\\n22:00:00 ingest.build: done: all good.mp4: not a readable" in p.stderr
    assert any(json.loads(line)["path"] == f"val/a/{HOSTILE}" for line in (out / "errors.jsonl").open())


def test_refuse_short_videos_makes_them_failures(caveats, tmp_path):
    src, _, _ = caveats
    p = _ingest("--src", str(src), "--out", str(tmp_path / "set"), "--short-side", "32",
                "--refuse-short-videos", "--max-error-fraction", "0.9")
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in (tmp_path / "set" / "errors.jsonl").open()]
    ledger = {line["path"]: line for line in lines if "warning" not in line}
    for name, why in (("few.mp4", "3 frames, fewer than --frames 8"), ("one_frame.mp4", "1 frame (h264)"),
                      ("picture.mp4", "1 frame (png)")):
        assert ledger[f"val/a/{name}"]["reason"].startswith(f"too short: {why}"), ledger[f"val/a/{name}"]
    assert "failures: 3 x too short, 2 x not a readable video" in p.stdout
    assert sorted(samples(tmp_path / "set", "val")) == ["hevc_c00", "plain_c00", "small_c00", "vp9_c00"]
