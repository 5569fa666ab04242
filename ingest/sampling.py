"""Which frames a clip keeps: TSN/TSM segment sampling.

The video's frames are cut into T equal segments; a clip takes one frame per segment. A
training clip takes a random offset inside each segment, seeded by (seed, video id, clip
index) so any machine and worker count picks the same frames. An evaluation clip takes the
centre of each segment, or for K clips per video, K evenly spread offsets. Videos with fewer
frames than T repeat frames, as TSM does.
"""
from __future__ import annotations

import hashlib

import numpy as np


def clip_rng(seed: int, video_id: str, clip: int) -> np.random.Generator:
    vid = int.from_bytes(hashlib.sha256(video_id.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, vid, clip])


def segment_offsets(num_segments: int, *, train: bool, seed: int, video_id: str, clip: int,
                    num_clips: int) -> np.ndarray:
    """Position of the chosen frame inside each segment, as a fraction in [0, 1)."""
    if train:
        return clip_rng(seed, video_id, clip).random(num_segments)
    return np.full(num_segments, (clip + 0.5) / num_clips)


def frame_indices(num_frames: int, num_segments: int, offsets: np.ndarray) -> list[int]:
    if num_frames < 1:
        raise ValueError("video has no frames")
    seg = num_frames / num_segments
    idx = np.floor(seg * (np.arange(num_segments) + offsets)).astype(int)
    return np.clip(idx, 0, num_frames - 1).tolist()


def clip_indices(num_frames: int, num_segments: int, *, train: bool, seed: int, video_id: str,
                 clip: int, num_clips: int) -> list[int]:
    offsets = segment_offsets(num_segments, train=train, seed=seed, video_id=video_id, clip=clip,
                              num_clips=num_clips)
    return frame_indices(num_frames, num_segments, offsets)
