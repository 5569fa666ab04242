"""The test-media factory makes what ffprobe says it should, and frame indices survive decoding."""
from __future__ import annotations

import os

import ffmpeg
import numpy as np
import pytest
from helpers import media

# factory, file name, what ffprobe must report for the video stream (and format), decoded frame count
VALID = [
    (media.make_video, "plain.mp4", {"codec_name": "h264", "pix_fmt": "yuv420p", "width": 64, "height": 48},
     20),
    (media.make_few_frames, "few.mp4", {"codec_name": "h264", "nb_frames": "3"}, 3),
    (media.make_high_res, "4k.mp4", {"codec_name": "h264", "width": 3840, "height": 2160}, 5),
    (media.make_vp9_webm, "vp9.webm", {"codec_name": "vp9", "format": "matroska,webm"}, 20),
    (media.make_hevc_mp4, "hevc.mp4", {"codec_name": "hevc", "codec_tag_string": "hvc1"}, 20),
    (media.make_mpeg4_avi, "mpeg4.avi", {"codec_name": "mpeg4", "format": "avi"}, 20),
    (media.make_mkv, "h264.mkv", {"codec_name": "h264", "format": "matroska,webm"}, 20),
    (media.make_yuv444, "444.mp4", {"pix_fmt": "yuv444p", "profile": "High 4:4:4 Predictive"}, 20),
    (media.make_vfr, "vfr.mp4", {"codec_name": "h264"}, 20),
    (media.make_rotated, "rotated.mp4", {"codec_name": "h264", "width": 64, "height": 48}, 20),
    (media.make_anamorphic, "anamorphic.mp4", {"sample_aspect_ratio": "2:1", "display_aspect_ratio": "8:3"},
     20),
]


def video_stream(path) -> dict:
    info = ffmpeg.probe(str(path))
    (stream,) = [s for s in info["streams"] if s["codec_type"] == "video"]
    return {**stream, "format": info["format"]["format_name"]}


@pytest.mark.parametrize("factory,name,expected,frames", VALID, ids=[v[1] for v in VALID])
def test_valid_kinds_probe_and_decode_to_their_frame_indices(tmp_path, factory, name, expected, frames):
    path = factory(tmp_path / name)
    assert path == tmp_path / name
    stream = video_stream(path)
    assert {k: stream[k] for k in expected} == expected
    decoded = media.decode_frames(path)
    assert [media.frame_index_from_image(f) for f in decoded] == list(range(frames))


def test_vfr_frame_durations_differ(tmp_path):
    packets = ffmpeg.probe(str(media.make_vfr(tmp_path / "vfr.mp4")), show_packets=None)["packets"]
    pts = sorted(float(p["pts_time"]) for p in packets)
    assert sorted(set(np.round(np.diff(pts), 3))) == [0.1, 0.2]


def test_rotated_has_display_matrix_and_decodes_turned_clockwise(tmp_path):
    path = media.make_rotated(tmp_path / "rotated.mp4")
    (side,) = video_stream(path)["side_data_list"]
    assert side["side_data_type"] == "Display Matrix" and side["rotation"] == -90
    first = media.decode_frames(path)[0]
    assert first.shape == (64, 48, 3)
    assert media.marker_corner(first) == "top-right"
    assert not (tmp_path / "rotated.mp4.plain.mp4").exists()


def test_pattern_round_trips_without_a_codec():
    for i in range(media.PERIOD):
        frame = media.pattern_frame(i, 32, 24)
        assert media.frame_index_from_image(frame) == i
        assert media.marker_corner(np.rot90(frame, k=-1)) == "top-right"
    assert media.frame_level(media.PERIOD + 3) == media.frame_level(3)


def _probe_fails(path) -> bool:
    try:
        ffmpeg.probe(str(path))
    except ffmpeg.Error:
        return True
    return False


def test_truncated_faststart_keeps_header_loses_frames(tmp_path):
    path = media.make_truncated(tmp_path / "cut.mp4", faststart=True)
    assert video_stream(path)["nb_frames"] == "30"
    decoded = media.decode_frames(path)
    assert 0 < len(decoded) < 30
    assert [media.frame_index_from_image(f) for f in decoded] == list(range(len(decoded)))


def test_truncated_without_moov_does_not_probe(tmp_path):
    path = media.make_truncated(tmp_path / "cut.mp4", faststart=False)
    assert path.stat().st_size > 0 and _probe_fails(path)


@pytest.mark.parametrize("kind", ["text", "random"])
def test_not_a_video_does_not_probe(tmp_path, kind):
    assert _probe_fails(media.make_not_a_video(tmp_path / "x.mp4", kind=kind))


def test_zero_byte(tmp_path):
    path = media.make_zero_byte(tmp_path / "empty.mp4")
    assert path.stat().st_size == 0 and _probe_fails(path)


def test_audio_only_has_no_video_stream(tmp_path):
    streams = ffmpeg.probe(str(media.make_audio_only(tmp_path / "a.mp4")))["streams"]
    assert [(s["codec_type"], s["codec_name"]) for s in streams] == [("audio", "aac")]


def test_unreadable_is_listed_but_cannot_be_opened(tmp_path):
    path = media.make_unreadable(tmp_path / "gone.mp4")
    assert os.listdir(tmp_path) == ["gone.mp4"] and path.is_symlink()
    with pytest.raises(FileNotFoundError):
        path.open("rb")


def test_directory_named_like_video(tmp_path):
    path = media.make_directory_named_like_video(tmp_path / "x.mp4")
    assert path.is_dir() and path.suffix == ".mp4"
    with pytest.raises(IsADirectoryError):
        path.open("rb")


def test_factories_create_missing_parent_directories(tmp_path):
    assert media.make_video(tmp_path / "train/walk/v.mp4", frames=2).is_file()
    assert media.make_unreadable(tmp_path / "val/broken/gone.mp4").is_symlink()
