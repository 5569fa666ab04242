"""TSN/TSM segment sampling: pure functions, checked exhaustively over small frame counts."""
import numpy as np

from ingest import sampling


def test_centre_sampling_matches_tsm_formula():
    for n in range(1, 120):
        got = sampling.clip_indices(n, 8, train=False, seed=0, video_id="v", clip=0, num_clips=1)
        tick = n / 8
        assert got == [min(n - 1, int(tick / 2 + tick * i)) for i in range(8)]


def test_training_frames_fall_inside_their_segments():
    for n in range(8, 200, 7):
        for clip in range(5):
            idx = sampling.clip_indices(n, 8, train=True, seed=3, video_id=f"v{n}", clip=clip, num_clips=5)
            for i, f in enumerate(idx):
                assert int(i * n / 8) <= f < (i + 1) * n / 8


def test_training_sampling_is_seeded_by_seed_video_and_clip():
    args = dict(train=True, video_id="abc", num_clips=4)
    a = sampling.clip_indices(300, 8, seed=1, clip=0, **args)
    assert a == sampling.clip_indices(300, 8, seed=1, clip=0, **args)
    assert a != sampling.clip_indices(300, 8, seed=2, clip=0, **args)
    assert a != sampling.clip_indices(300, 8, seed=1, clip=1, **args)
    assert a != sampling.clip_indices(300, 8, seed=1, clip=0, train=True, video_id="abd", num_clips=4)


def test_short_videos_repeat_frames_in_order():
    idx = sampling.clip_indices(3, 8, train=False, seed=0, video_id="v", clip=0, num_clips=1)
    assert idx == sorted(idx) and set(idx) == {0, 1, 2}
    idx = sampling.clip_indices(1, 8, train=True, seed=0, video_id="v", clip=0, num_clips=1)
    assert idx == [0] * 8


def test_multi_clip_evaluation_spreads_offsets():
    clips = [sampling.clip_indices(80, 8, train=False, seed=0, video_id="v", clip=k, num_clips=4)
             for k in range(4)]
    firsts = [c[0] for c in clips]
    assert firsts == sorted(firsts) and len(set(firsts)) == 4
    assert np.all(np.diff(clips, axis=1) == 10)
