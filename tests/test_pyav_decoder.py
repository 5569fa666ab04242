"""The in-process decoder: frames decoded from only the packets they need are bit-identical to a
full decode's, on every codec and container of the test media; counts are what is displayed;
the command-line decoder agrees on which frames they are."""
from __future__ import annotations

import random

import av
import numpy as np
import pytest
from helpers import media

from ingest.decode import bitstream, ffmpeg_cli, mp4header, packets, pyav_decoder
from ingest.decode.deadline import Deadline

MOVING = dict(frames=48, texture=True)  # textured bottom strip moving a pixel a frame: real prediction
# The pattern's level changes every frame, which x264's scene-cut detection takes for cuts: with
# its defaults it codes no B-frame here (real videos have them: bench/ingest.py), hence scenecut=0.
KINDS = {
    "x264_default.mp4": lambda p: media.make_video(p, **MOVING),
    "x264_bframes.mp4": lambda p: media.make_video(p, **MOVING,
                                                   extra_output_args={"x264-params": "scenecut=0"}),
    "x264_open_gop.mp4": lambda p: media.make_video(p, **MOVING, extra_output_args={
        "x264-params": "open-gop=1:keyint=12:min-keyint=12:scenecut=0"}),
    "x264_gop12.mkv": lambda p: media.make_video(p, **MOVING,
                                                 extra_output_args={"g": 12, "format": "matroska"}),
    "x264_annexb.ts": lambda p: media.make_video(p, **MOVING, extra_output_args={
        "g": 12, "x264-params": "scenecut=0", "format": "mpegts"}),
    "hevc.mp4": lambda p: media.make_video(p, **MOVING, codec="libx265", extra_output_args={
        "tag:v": "hvc1", "x265-params": "log-level=error:keyint=12:open-gop=1"}),
    "vp9_altref.webm": lambda p: media.make_video(p, **MOVING, codec="libvpx-vp9", extra_output_args={
        "auto-alt-ref": 1, "lag-in-frames": 16, "g": 24, "deadline": "good", "cpu-used": 8}),
    "mpeg4_bframes.avi": lambda p: media.make_video(p, **MOVING, codec="mpeg4",
                                                    extra_output_args={"bf": 2, "q:v": 2, "g": 12}),
    "vfr.mp4": lambda p: media.make_vfr(p, frames=48),
    "edit_list.mp4": lambda p: media.make_edit_list(p, texture=True, extra_output_args={
        "g": 24, "x264-params": "scenecut=0"}),
    "rotated.mp4": media.make_rotated,
    "x264_raw.h264": lambda p: media.make_video(p, **MOVING,
                                                extra_output_args={"x264-params": "scenecut=0",
                                                                   "format": "h264"}),
}
NO_TIMESTAMPS = {"x264_raw.h264"}  # an elementary stream: display order only a decode can tell
SKIPS_SOME = {"x264_bframes.mp4", "x264_open_gop.mp4", "x264_annexb.ts", "hevc.mp4", "mpeg4_bframes.avi",
              "edit_list.mp4"}


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("codecs")
    return {name: str(make(root / name)) for name, make in KINDS.items()}


def planes(frame) -> list[np.ndarray]:
    return [np.asarray(p).copy() for p in frame.planes]


def full_decode(path) -> list[list[np.ndarray]]:
    with av.open(path) as c:
        return [planes(f) for f in c.decode(video=0)]


def selected(path, picks):
    return pyav_decoder.decode_frames(path, lambda n: picks, deadline=Deadline(60))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_selected_frames_are_bit_identical_to_a_full_decode(videos, kind):
    path = videos[kind]
    full = full_decode(path)
    pick_sets = [[i] for i in range(len(full))]  # every frame alone: every cut of the plan
    rng = random.Random(kind)
    pick_sets += [sorted(rng.sample(range(len(full)), 8)) for _ in range(3)]
    fed = []
    for picks in pick_sets:
        found = selected(path, picks)
        assert found.num_frames == len(full)
        assert found.counted_by == ("decoded" if kind in NO_TIMESTAMPS else "packets")
        for i in picks:
            assert all(np.array_equal(a, b) for a, b in zip(planes(found.frames[i]),
                                                            full[i])), (kind, picks, i)
        fed.append(found.packets_decoded)
    if kind in SKIPS_SOME:  # frames nobody needs were left out (not just the tail after the last pick)
        assert fed[-4] < len(full), fed  # the last frame alone


def test_h264_non_reference_frames_are_those_ffmpeg_skips(videos):
    path = videos["x264_bframes.mp4"]
    with av.open(path) as c:
        s = c.streams.video[0]
        parse = bitstream.parser("h264", s.codec_context.extradata)
        index = [packets.Packet(p.pts, reference=parse(p).reference) for p in c.demux(s) if p.size]
    order = packets.displayed(index)
    ours = [d for d, i in enumerate(order) if index[i].reference]
    assert ours == media.reference_frame_indices(path, fps=10) and len(ours) < len(order)


def test_counts_are_what_is_displayed_with_an_edit_list(videos):
    path = videos["edit_list.mp4"]
    shown = media.decode_frames(path)  # the ffmpeg command line, full decode
    head = mp4header.read(path)
    with av.open(path) as c:
        listed = c.streams.video[0].frames
    assert len(shown) == head.num_frames == selected(path, [0]).num_frames < listed == 48
    assert head.edited and ffmpeg_cli.probe(path, Deadline(60)).frame_count_source == "edit list"
    first = pyav_decoder.decode(path, lambda n: [0, n - 1], 32, deadline=Deadline(60)).frames
    assert media.frame_index_from_image(np.asarray(first[0].convert("RGB"))) == 13  # cut at 1.3 s, 10 fps
    assert media.frame_index_from_image(np.asarray(first[len(shown) - 1].convert("RGB"))) == 47 % media.PERIOD


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_command_line_decoder_agrees(videos, kind):
    def wanted(n):
        return [min(n - 1, int(n / 16 + n / 8 * i)) for i in range(8)]

    ours = pyav_decoder.decode(videos[kind], wanted, 32, deadline=Deadline(60))
    ref = ffmpeg_cli.decode(videos[kind], wanted, 32, deadline=Deadline(60))
    assert ours.info.num_frames == ref.info.num_frames and sorted(ours.frames) == sorted(ref.frames)
    for i, image in ours.frames.items():
        a, b = np.asarray(image.convert("RGB"), np.int16), np.asarray(ref.frames[i], np.int16)
        assert a.shape == b.shape
        assert media.frame_index_from_image(a) == media.frame_index_from_image(b)
        assert media.marker_corner(a) == media.marker_corner(b)
        # Both scale with swscale's area filter, but FFmpeg 8 (PyAV's) and 5.1 (Debian's binary)
        # round differently at sharp chroma edges (the marker's): same pixels within a level on average.
        assert np.abs(a - b).mean() < 2.5


# Widths that are not multiples of 16, the common pre-resized Kinetics sizes among them: with
# width % 8 in 1..4, swscale's unscaled YUV-to-RGB conversion into an unpadded 4-byte buffer left
# the last columns unwritten (garbage that changed from run to run).
UNSCALED_SIZES = [(340, 256), (226, 170), (354, 200), (60, 36), (90, 50)]


@pytest.mark.parametrize("width,height", UNSCALED_SIZES)
def test_frames_kept_at_their_size_equal_ffmpegs_decode_to_the_last_column(tmp_path, width, height):
    path = media.make_video(tmp_path / f"{width}x{height}.mp4", frames=12, width=width, height=height,
                            texture=True)
    full = media.decode_frames(path)  # the ffmpeg command line's own RGB
    picks = [1, 4, 6, 11]
    for _ in range(2):  # twice: the garbage differed from call to call
        ours = pyav_decoder.decode(str(path), lambda n: picks, height, deadline=Deadline(60)).frames
        for i in picks:
            a = np.asarray(ours[i].convert("RGB"))
            assert a.shape == full[i].shape
            worst = np.abs(a.astype(np.int16) - full[i]).max(axis=(0, 2))
            assert not worst.any(), (f"frame {i}: columns {np.flatnonzero(worst).tolist()} differ by up to "
                                     f"{worst.max()}")


def random_stream(rng: random.Random, n: int) -> tuple[list[packets.Packet], list[set[int]]]:
    """A random decode-order stream and, per packet, the packets it refers to: only references
    before it and at or after the last barrier, as every codec guarantees."""
    flags = [(rng.random() < 0.5, i == 0 or rng.random() < 0.1) for i in range(n)]
    index, deps, last_barrier = [], [], 0
    for i, (ref, barrier) in enumerate(flags):
        last_barrier = i if barrier else last_barrier
        refs = [j for j in range(last_barrier, i) if flags[j][0]]
        deps.append(set(rng.sample(refs, min(len(refs), rng.randint(0, 3)))))
        index.append(packets.Packet(pts=i, reference=ref, barrier=barrier))
    return index, deps


def test_plan_feeds_every_dependency_of_every_pick_and_nothing_after_the_last():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(1, 40)
        index, deps = random_stream(rng, n)
        picks = set(rng.sample(range(n), rng.randint(1, min(n, 8))))
        feed = packets.plan(index, picks)
        assert feed == sorted(set(feed)) and picks <= set(feed) and max(feed) == max(picks)
        need, todo = set(), list(picks)
        while todo:  # every packet a pick depends on, directly or not
            i = todo.pop()
            if i not in need:
                need.add(i)
                todo += deps[i]
        assert need <= set(feed)
        assert all(index[i].reference or i in picks for i in feed)


def test_displayed_orders_by_pts_without_discarded_packets():
    index = [packets.Packet(0), packets.Packet(3), packets.Packet(1, discard=True), packets.Packet(2)]
    assert packets.displayed(index) == [0, 3, 1]
    assert packets.displayed([packets.Packet(None), packets.Packet(1)]) is None
    assert packets.displayed([packets.Packet(1), packets.Packet(1)]) is None
