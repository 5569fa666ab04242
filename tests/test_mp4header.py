"""The in-process MP4 header reader agrees with ffprobe on every MP4 kind it accepts."""
from fractions import Fraction

import ffmpeg
import pytest
from helpers import media

from ingest.decode import ffmpeg_cli, mp4header
from ingest.decode.deadline import Deadline

KINDS = {
    "plain": lambda p: media.make_video(p, frames=24),
    "few": media.make_few_frames,
    "hevc": media.make_hevc_mp4,
    "yuv444": media.make_yuv444,
    "vfr": media.make_vfr,
    "rotated": media.make_rotated,
    "anamorphic": media.make_anamorphic,
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_header_matches_ffprobe(kind, tmp_path):
    path = str(KINDS[kind](tmp_path / f"{kind}.mp4"))
    head = mp4header.read(path)
    assert head is not None
    s = next(s for s in ffmpeg.probe(path)["streams"] if s["codec_type"] == "video")
    assert head.num_frames == int(s["nb_frames"])
    assert (head.width, head.height) == (s["width"], s["height"])
    assert head.codec == s["codec_name"]
    assert head.rotation == ffmpeg_cli.rotation(s)
    sar = Fraction(s.get("sample_aspect_ratio", "1:1").replace(":", "/"))
    assert head.sar == pytest.approx(float(sar) if sar else 1.0)


def test_non_mp4_and_garbage_fall_back(tmp_path):
    assert mp4header.read(str(media.make_mkv(tmp_path / "a.mkv"))) is None
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00\x10ftypisom" + b"\xff" * 100)
    assert mp4header.read(str(bad)) is None
    assert mp4header.read(str(tmp_path / "absent.mp4")) is None


def test_probe_gives_the_same_facts_either_way(tmp_path):
    path = str(media.make_anamorphic(tmp_path / "r.mp4"))
    fast = ffmpeg_cli.probe(path, Deadline(60))
    slow_copy = tmp_path / "r.mkv"  # same stream in a container the fast path does not read
    ffmpeg.input(path).output(str(slow_copy), c="copy").run(quiet=True)
    slow = ffmpeg_cli.probe(str(slow_copy), Deadline(60))
    assert (fast.width, fast.height, fast.num_frames) == (slow.width, slow.height, slow.num_frames)
