"""``ingest build --motion mv|flow``: the motion fields stored beside the frames.

A textured picture slides by a known (u, v) pixels per frame (libx264 with B-frames), and the
stored fields are checked against that translation, against the codec's vectors read directly
with PyAV, and against OpenCV's flow on the same frames decoded here; a build without
``--motion`` is checked to stay byte for byte what it was.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import av
import cv2
import ffmpeg
import numpy as np
import pytest
from PIL import Image

from ingest import build_cli, registry, staging
from ingest.build import build
from ingest.clips import ClipConfig, make_clips
from ingest.decode import pyav_decoder
from ingest.decode.deadline import Deadline
from ingest.sources import Video
from shards.format import motioncolour, motionfield
from shards.format.manifest import Manifest
from shards.format.sample import parse
from shards.read.clipindex import ClipIndex, read_clip
from shards.tools import preview, reshard, verify
from shards.tools.stats import collect

W, H, FRAMES = 128, 96, 24
U, V = -3.0, 2.0  # content moves 3 px left and 2 px down per frame
FIELD_W, FIELD_H = W // motionfield.GRID, H // motionfield.GRID


def _translated(path: Path, x264: str | None = None, blur: int = 3, **codec) -> Path:
    """Frame i shows a fixed texture shifted by i * (U, V): seen through a window that slides;
    libx264 with ``x264`` parameters, or the ``codec`` output options given."""
    rng = np.random.default_rng(1)
    texture = rng.integers(0, 256, (H // 4 + 20, W // 4 + 30, 3), dtype=np.uint8).repeat(4, 0).repeat(4, 1)
    texture = cv2.GaussianBlur(texture, (blur, blur), 0)
    y0 = 2 * FRAMES + 4
    frames = [texture[y0 - int(V) * i: y0 - int(V) * i + H, -int(U) * i: -int(U) * i + W]
              for i in range(FRAMES)]
    raw = b"".join(np.ascontiguousarray(f).tobytes() for f in frames)
    (ffmpeg.input("pipe:", format="rawvideo", pix_fmt="rgb24", s=f"{W}x{H}", framerate=10)
     .output(str(path), pix_fmt="yuv420p",
             **(codec or {"vcodec": "libx264", "crf": 12, "x264-params": x264}))
     .global_args("-hide_banner", "-loglevel", "error").overwrite_output().run(input=raw, quiet=True))
    return path


@pytest.fixture(scope="module")
def translated(tmp_path_factory) -> Path:
    """B-frames in a fixed pattern (I B B P B B P ...), one reference per list, so the test can
    tell each frame's reference distance from picture types alone."""
    return _translated(tmp_path_factory.mktemp("motion") / "slide.mp4",
                       "bframes=2:b-adapt=0:b-pyramid=none:ref=1")


def _video(path: Path, split: str = "val") -> Video:
    return Video(split, f"{split}/a/{path.name}", str(path), "a", path.stem, path.stat().st_size, "file")


def _fields(path: Path, kind: str, frames: int = 8) -> tuple[dict, list[int]]:
    """The stored fields of one eval clip: {frame index: (field, valid)}, and the indices."""
    ((key, label, data),), _ = make_clips(_video(path), 0, ClipConfig(frames=frames, short_side=H,
                                                                      motion=kind))
    sample = parse(data, key, label=label, frames=frames, motion=kind)
    indices = sample.meta()["frame_indices"]
    return {i: motionfield.decode(field) for i, field in zip(indices, sample.fields)}, indices


def _picture_types(path: Path) -> list[str]:
    with av.open(str(path)) as c:
        return [" IPB"[int(f.pict_type)] for f in c.decode(video=0)]  # AVPictureType: 1 I, 2 P, 3 B


INTERIOR = (slice(2, -2), slice(2, -2))  # cells whose content does not enter or leave the frame


@pytest.fixture(scope="module")
def pyramid(tmp_path_factory) -> Path:
    """x264's default B-pyramid: the middle B-frame of three is a reference for the others and
    decoded after the P-frame it is displayed before, which the P-frame cannot refer to."""
    return _translated(tmp_path_factory.mktemp("motion") / "pyramid.mp4",
                       "bframes=3:b-adapt=0:b-pyramid=normal:ref=1")


@pytest.fixture(scope="module")
def xvid(tmp_path_factory) -> Path:
    """MPEG-4 Part 2 in AVI with B-frames, as UCF101 and HMDB51 ship: its B-frames' blocks are
    mostly direct mode, whose vectors FFmpeg exports as zero. A smoother texture than x264's: on
    the sharp one, FFmpeg's MPEG-4 encoder finds wrong matches in the first P-frames."""
    return _translated(tmp_path_factory.mktemp("motion") / "slide.avi", blur=9, vcodec="mpeg4", vtag="XVID",
                       bf=1, g=12, **{"qscale:v": 2})


@pytest.mark.parametrize("video, frames", [("translated", 12), ("pyramid", 12), ("xvid", 8)])
def test_mv_fields_give_the_translation_for_p_and_b_frames(request, video, frames):
    path = request.getfixturevalue(video)
    fields, indices = _fields(path, "mv", frames=frames)
    types = _picture_types(path)
    seen = set()
    for i in indices:
        field, valid = fields[i]
        assert field.shape == (FIELD_H, FIELD_W, 2)
        if types[i] == "I":
            assert not valid.any() and not field.any(), f"intra frame {i}: zero and invalid"
            continue
        inside = valid[INTERIOR]
        assert inside.mean() > 0.9, f"frame {i} ({types[i]}): {inside.mean():.0%} of the interior inter-coded"
        mean = field[INTERIOR][inside].mean(axis=0)
        assert abs(mean[0] - U) <= motionfield.STEP and abs(mean[1] - V) <= motionfield.STEP, \
            f"frame {i} ({types[i]}): mean motion {mean}, expected ({U}, {V})"
        seen.add(types[i])
    assert seen == {"P", "B"}, f"picture types checked: {seen}"


@pytest.mark.parametrize("x264", ["bframes=2:b-adapt=0:b-pyramid=none:ref=1",
                                  "bframes=3:b-adapt=0:b-pyramid=normal:ref=1"])
def test_an_elementary_stream_decoded_twice_gets_the_fields_its_mp4_gets(tmp_path, x264):
    """A ``.h264`` elementary stream has no timestamps: the decoder decodes it twice, and the frames'
    display order comes from the packets' decode indices stamped as their pts. The very same
    bitstream in an MP4 is decoded from its packet index: the fields must be the same, byte for
    byte, and as valid (before: the two-pass fields were all invalid, silently)."""
    mp4 = _translated(tmp_path / "slide.mp4", x264)
    raw = _translated(tmp_path / "slide.h264", x264, vcodec="libx264", crf=12, f="h264",
                      **{"x264-params": x264})
    found = pyav_decoder.decode_frames(str(raw), lambda n: [0], deadline=Deadline(60))
    assert found.counted_by == "decoded", "the elementary stream takes the two-pass path"
    stored, indices = _fields(mp4, "mv", frames=12)
    raw_stored, raw_indices = _fields(raw, "mv", frames=12)
    assert raw_indices == indices
    types = _picture_types(raw)
    for i in indices:
        (field, valid), (raw_field, raw_valid) = stored[i], raw_stored[i]
        assert (np.array_equal(raw_valid, valid) and np.array_equal(raw_field,
                                                                    field)), f"frame {i} ({types[i]})"
        if types[i] != "I":
            assert valid[INTERIOR].mean() > 0.9, f"frame {i} ({types[i]}): {valid[INTERIOR].mean():.0%} valid"


def test_xvid_b_frames_take_their_references_motion(xvid):
    """Every B-frame of the Xvid clip, the one before an intra frame included (whose future
    reference has no vectors: it takes its past one's), read with PyAV here: the codec's own
    vectors for it are all zero, its stored field is the translation."""
    types = _picture_types(xvid)
    b_frames = [i for i, t in enumerate(types) if t == "B"]
    assert any(types[i + 1] == "I" for i in b_frames), "a B-frame before an intra frame is checked"
    with av.open(str(xvid)) as c:
        stream = c.streams.video[0]
        stream.codec_context.options = {"flags2": "+export_mvs"}
        own = {i: f.side_data.get("MOTION_VECTORS").to_ndarray() for i, f in enumerate(c.decode(stream))
               if i in b_frames}
    decoded = pyav_decoder.decode(str(xvid), lambda n: b_frames, H, deadline=Deadline(60),
                                  motion_vectors=True)
    for i in b_frames:
        assert (not own[i]["motion_x"].any()
                and not own[i]["motion_y"].any()), f"frame {i}: FFmpeg's own vectors"
        field, valid = decoded.motion[i]
        assert valid[INTERIOR].mean() > 0.9, (f"B-frame {i}: {valid[INTERIOR].mean():.0%} of the interior "
                                              f"valid")
        mean = field[INTERIOR][valid[INTERIOR]].mean(axis=0)
        assert np.abs(mean - (U, V)).max() <= motionfield.STEP, f"B-frame {i}: mean motion {mean}"


def test_mv_fields_equal_the_vectors_read_directly(translated):
    """Each 16 x 16 block's vectors (one per reference), read here with PyAV and divided by the
    reference distance from the picture types, against the 2 x 2 stored cells it covers."""
    fields, indices = _fields(translated, "mv", frames=12)
    types = _picture_types(translated)
    anchors = [i for i, t in enumerate(types) if t in "IP"]
    compared = 0
    with av.open(str(translated)) as c:
        stream = c.streams.video[0]
        stream.codec_context.options = {"flags2": "+export_mvs"}
        for i, frame in enumerate(c.decode(stream)):
            side = frame.side_data.get("MOTION_VECTORS")
            if i not in indices or side is None:
                continue
            back = i - max(a for a in anchors if a < i)
            ahead = min(a for a in anchors if a > i) - i if types[i] == "B" else None
            blocks = {}
            for mv in side.to_ndarray():
                distance = back if mv["source"] < 0 else ahead
                velocity = np.array([mv["motion_x"], mv["motion_y"]]) / mv["motion_scale"] / distance
                blocks.setdefault((mv["dst_x"], mv["dst_y"], mv["w"], mv["h"]), []).append(
                    -velocity if mv["source"] < 0 else velocity)
            field, valid = fields[i]
            for (x, y, w, h), velocities in blocks.items():
                if (w, h) != (16, 16):
                    continue
                cells = (slice((y - 8) // 8, (y + 8) // 8), slice((x - 8) // 8, (x + 8) // 8))
                assert valid[cells].all()
                expected = np.mean(velocities, axis=0)
                assert np.abs(field[cells] - expected).max() <= motionfield.STEP / 2 + 1e-4, \
                    (f"frame {i} block at ({x}, {y}): stored {field[cells].reshape(-1, 2)}, "
                     f"vectors give {expected}")
                compared += 1
    assert compared >= 20, f"only {compared} 16x16 blocks compared"


def test_flow_fields_equal_opencv_on_the_same_frames(translated):
    fields, indices = _fields(translated, "flow")
    with av.open(str(translated)) as c:
        gray = [f.to_ndarray(format="gray") for f in c.decode(video=0)]
    dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)
    for i in indices:
        field, valid = fields[i]
        if i == 0:
            assert not valid.any()
            continue
        dense = dis.calc(gray[i - 1], gray[i], None)
        expected = dense.reshape(FIELD_H, 8, FIELD_W, 8, 2).mean(axis=(1, 3))
        assert valid.all()
        assert np.abs(field - np.clip(expected, -motionfield.BOUND,
                                      motionfield.BOUND)).mean() < 0.25, f"frame {i}"
        mean = field[INTERIOR].mean(axis=(0, 1))
        assert np.abs(mean - (U, V)).max() <= motionfield.STEP * 2, f"frame {i}: mean flow {mean}"


FIXTURES = Path(__file__).parent / "fixtures"


def _digests(src: Path, out: Path) -> dict:
    """What ``tests/fixtures/motion-rgb-only.json`` records of a build of ``src`` into ``out``."""
    manifest = (out / "manifest.json").read_bytes().replace(str(src).encode(), b"SRC")
    return {"manifest_sha256": hashlib.sha256(manifest).hexdigest(),
            "shards": {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
                       for p in sorted(out.glob("*/*.tar"))}}


@pytest.fixture(scope="module")
def fixture_src(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("motion-build") / "src"
    shutil.copytree(FIXTURES / "motion-src", src)
    return src


def test_build_without_motion_is_byte_identical_to_before(ray_local, fixture_src, tmp_path):
    """The command line without --motion, and motion="none", give the bytes the code gave before
    --motion existed (recorded from main's code in the fixture)."""
    parser = argparse.ArgumentParser()
    build_cli.add_arguments(parser)
    absent = tmp_path / "absent"
    args = parser.parse_args(["--src", str(fixture_src), "--out", str(absent), "--frames", "4",
                              "--short-side", "32", "--shard-samples", "2", "--workers", "1"])
    assert build_cli.run(args) == 0
    none = tmp_path / "none"
    build(str(fixture_src), str(none), ClipConfig(frames=4, short_side=32, motion="none"), workers=1,
          shard_size=None, shard_samples=2)
    expected = json.loads((FIXTURES / "motion-rgb-only.json").read_text())
    del expected["about"]
    assert _digests(fixture_src, absent) == expected
    assert _digests(fixture_src, none) == expected


@pytest.mark.parametrize("kind", ["mv", "flow"])
def test_a_build_with_motion_is_verified_counted_and_resharded(ray_local, fixture_src, tmp_path, kind,
                                                               capsys):
    out = tmp_path / "set"
    build(str(fixture_src), str(out), ClipConfig(frames=4, short_side=32, motion=kind), workers=1,
          shard_samples=2)
    m = Manifest.load(str(out))
    assert m.motion == kind and m.config["clip"]["motion"] == kind
    shard = m.splits["train"].shards[0]
    data = (out / shard.name).read_bytes()[shard.offsets[0]:][:shard.lengths[0]]
    sample = parse(data, shard.keys[0], label=shard.labels[0], frames=4, motion=kind)  # a field per frame
    assert len(sample.fields) == 4
    field, valid = motionfield.decode(sample.fields[-1])
    assert field.shape == (4, 6, 2)  # 32 px high, 43 wide: 4 x 6 cells of 8 px
    assert verify.verify(m, deep=True) == []

    stats = collect(m, probe=0)["splits"]["train"]["motion"]
    assert stats["kind"] == kind and stats["cells"] == 2 * 4 * 24 and 0 < stats["valid_fraction"] <= 1

    resharded = reshard.reshard(str(out), str(tmp_path / "resharded"), shard_samples=1)
    assert resharded.motion == kind and verify.verify(resharded, deep=True) == []

    _preview_shows_the_fields(out, m, tmp_path / "preview")

    # a damaged field is found by --deep
    data = bytearray((out / shard.name).read_bytes())
    start = data.index(bytes(sample.fields[-1]))
    data[start + 40:start + 60] = bytes(20)
    (out / shard.name).write_bytes(bytes(data))
    problems = [p.message for p in verify.verify(m, deep=True)]
    assert f"motion field {motionfield.member(3, kind)} does not decode" in " ".join(problems), problems


def _preview_shows_the_fields(out: Path, m: Manifest, where: Path) -> None:
    """``shards preview`` of the set: under each clip's frames a row of its fields, coloured by
    ``shards.format.motioncolour`` (the viewer's colouring) with the colour wheel and the clip's scale,
    in the PNG and the HTML page. Before: the fields were never shown."""
    done = subprocess.run([sys.executable, "-m", "shards", "preview", str(out), "--split", "train", "--clips",
                           "2",
                           "--height", "32", "--out", str(where / "sheet.png"), "--html", str(where / "h")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    sheet = Image.open(where / "sheet.png").convert("RGB")
    html = (where / "h" / "index.html").read_text()
    assert 'src="motion/legend.png"' in html and "direction: hue" in html
    index = ClipIndex(m)
    chosen = preview.pick(index, "train", None, 2)
    for row, clip in enumerate(chosen):
        fields = [bytes(f) for f in read_clip(m, clip).fields]
        assert len(fields) == 4
        pictures, scale = motioncolour.render(fields, (43, 32))
        # the fields' row
        top = preview.GAP + row * (2 * (32 + preview.GAP) + 2 * preview.GAP) + 32 + preview.GAP
        for t, picture in enumerate(pictures):
            x = preview.LABEL_WIDTH + t * (43 + preview.GAP)
            assert sheet.crop((x, top, x + 43, top + 32)).tobytes() == picture.tobytes(), (row, t)
            shown = Image.open(where / "h" / "motion" / f"{row:04d}_{t:02d}.png").convert("RGB")
            assert shown.tobytes() == picture.tobytes()
            assert f'src="motion/{row:04d}_{t:02d}.png"' in html
        assert f"full colour: {scale:.2g} px/frame" in html
    assert (where / "h" / "motion" / "legend.png").is_file()


def test_motion_colours_follow_the_optical_flow_convention():
    """Baker et al.'s colour wheel (Middlebury): right red, down yellow, left cyan, up blue-violet;
    no motion white, half the scale half saturated, beyond it darker; unknown black. One stray long
    vector does not set a clip's scale."""
    cases = {(1, 0): (255, 0, 0), (0, 1): (255, 229, 0), (-1, 0): (0, 209, 255), (0, -1): (88, 0, 255),
             (0, 0): (255, 255, 255), (0.5, 0): (255, 127, 127), (2, 0): (191, 0, 0)}
    field = np.array([list(cases)], dtype=float)
    got = motioncolour.colour(field, np.ones(field.shape[:2], bool), scale=1.0)
    assert [tuple(map(int, c)) for c in got[0]] == list(cases.values())
    assert motioncolour.colour(field, np.zeros(field.shape[:2], bool), 1.0).max() == 0  # not known: black
    typical = np.dstack([np.full((12, 12), 3.0), np.zeros((12, 12))])
    stray = typical.copy()
    stray[0, 0] = (20, 0)
    ok = np.ones((12, 12), bool)
    assert motioncolour.clip_scale([(typical, ok)] * 3 + [(stray, ok)]) == 3.0


def test_motion_is_in_the_staging_key_and_the_catalog_id(fixture_src):
    video = _video(next(fixture_src.rglob("*.mp4")))
    keys = {kind: staging.video_key(video, 0, ClipConfig(motion=kind)) for kind in ("none", "mv", "flow")}
    ids = {kind: registry.plan(str(fixture_src), ClipConfig(motion=kind)).id
           for kind in ("none", "mv", "flow")}
    assert len(set(keys.values())) == 3 and len(set(ids.values())) == 3
    assert keys["none"] == staging.video_key(video, 0, ClipConfig())
    assert ids["none"] == registry.plan(str(fixture_src), ClipConfig()).id
