"""``ingest synth``: layout, determinism, resume, and classes that only motion tells apart."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import ffmpeg
import numpy as np
import pytest

from ingest import cli, synth

SMALL = dict(classes=2, train_per_class=2, val_per_class=1, seconds=0.5)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def decode_gray(path: Path, width: int, height: int) -> np.ndarray:
    raw, _ = ffmpeg.input(str(path)).output("pipe:", format="rawvideo", pix_fmt="gray").run(quiet=True)
    return np.frombuffer(raw, np.uint8).reshape(-1, height, width).astype(np.float64)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """All six classes, 8 one-second videos each, decoded to gray: (out, videos, labels, summary)."""
    out = tmp_path_factory.mktemp("synth")
    summary = synth.synthesize(str(out), classes=6, train_per_class=6, val_per_class=2, seconds=1.0,
                               workers=2)
    paths = sorted(out.rglob("*.mp4"))
    labels = np.array([synth.CLASSES.index(p.parent.name) for p in paths])
    return out, np.stack([decode_gray(p, 160, 120) for p in paths]), labels, summary


def test_layout_and_stream(dataset):
    out, videos, _, summary = dataset
    expected = {f"{split}/{label}/{label}_{split}_{i:04d}.mp4"
                for split, n in (("train", 6), ("val", 2)) for label in synth.CLASSES for i in range(n)}
    assert set(files(out)) == expected
    assert summary["videos"] == {"train": 36, "val": 12} and summary["written"] == 48
    stream = ffmpeg.probe(str(out / "val/rotate_cw/rotate_cw_val_0001.mp4"))["streams"][0]
    assert (stream["codec_name"], stream["pix_fmt"], stream["width"],
            stream["height"]) == ("h264", "yuv420p", 160, 120)
    assert (stream["r_frame_rate"], stream["nb_frames"]) == ("10/1", "10")
    assert videos.shape == (48, 10, 120, 160)


def test_same_arguments_give_identical_bytes_whatever_the_worker_count(tmp_path):
    synth.synthesize(str(tmp_path / "a"), workers=1, **SMALL)
    synth.synthesize(str(tmp_path / "b"), workers=2, **SMALL)
    a, b = files(tmp_path / "a"), files(tmp_path / "b")
    assert len(a) == 6 and a == b
    synth.synthesize(str(tmp_path / "c"), workers=1, **{**SMALL, "seed": 1})
    assert set(files(tmp_path / "c")) == set(a) and files(tmp_path / "c") != a


def test_resume_writes_only_missing_videos(tmp_path):
    synth.synthesize(str(tmp_path), workers=1, **SMALL)
    before = files(tmp_path)
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.mp4")}
    gone = tmp_path / "train/move_right/move_right_train_0001.mp4"
    gone.unlink()
    summary = synth.synthesize(str(tmp_path), workers=1, **SMALL)
    assert (summary["written"], summary["skipped"]) == (1, 5)
    assert files(tmp_path) == before
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items() if p != gone)


def test_cli_preset_with_override(tmp_path, capsys):
    assert cli.main(["synth", "--out", str(tmp_path), "--preset", "bench-small", "--seconds", "0.2",
                     "--classes", "1",
                     "--train-per-class", "1", "--val-per-class", "0", "--workers", "1"]) == 0
    (path,) = tmp_path.rglob("*.mp4")
    stream = ffmpeg.probe(str(path))["streams"][0]
    assert (stream["width"], stream["height"], stream["r_frame_rate"],
            stream["nb_frames"]) == (340, 256, "30/1", "6")
    assert "1 written" in capsys.readouterr().out


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        synth.synthesize(str(tmp_path), classes=len(synth.CLASSES) + 1)
    with pytest.raises(ValueError):
        synth.synthesize(str(tmp_path), width=161)
    assert not os.listdir(tmp_path)


def anova_f(features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """One-way ANOVA F statistic of each feature column across the label groups (about 1 when the
    groups share a distribution)."""
    groups = np.unique(labels)
    means = np.stack([features[labels == g].mean(0) for g in groups])
    counts = np.array([(labels == g).sum() for g in groups])[:, None]
    between = (counts * (means - features.mean(0)) ** 2).sum(0) / (len(groups) - 1)
    within = sum(((features[labels == g] - means[i]) ** 2).sum(0) for i, g in enumerate(groups))
    return between / (within / (len(features) - len(groups)))


def nearest_centroid_loo(features: np.ndarray, labels: np.ndarray) -> float:
    """Leave-one-out accuracy of a nearest-class-mean classifier on standardised features."""
    z = (features - features.mean(0)) / features.std(0)
    hits = 0
    for i in range(len(z)):
        rest = np.arange(len(z)) != i
        centroids = {g: z[rest & (labels == g)].mean(0) for g in np.unique(labels)}
        hits += min(centroids, key=lambda g: ((centroids[g] - z[i]) ** 2).sum()) == labels[i]
    return hits / len(z)


def appearance(frame: np.ndarray) -> np.ndarray:
    """Single-frame features: mean brightness of a 4x4 grid of blocks, contrast, edge energy."""
    h, w = frame.shape
    blocks = frame[: h // 4 * 4, : w // 4 * 4].reshape(4, h // 4, 4, w // 4).mean(axis=(1, 3)).ravel()
    return np.concatenate([blocks, [frame.std(), np.abs(np.diff(frame, axis=1)).mean()]])


def motion(video: np.ndarray) -> np.ndarray:
    """Mean rigid motion (dx, dy, spin) between consecutive frames, by Lucas-Kanade on the torus
    restricted to the pixels that change, about their circular centroid."""
    h, w = video.shape[1:]
    estimates = []
    for a, b in zip(video[:-1], video[1:]):
        image, change = (a + b) / 2, b - a
        gx = (np.roll(image, -1, 1) - np.roll(image, 1, 1)) / 2
        gy = (np.roll(image, -1, 0) - np.roll(image, 1, 0)) / 2
        weight = np.abs(change)

        def centre(axis: int, n: int) -> float:
            phase = (weight.sum(axis) * np.exp(2j * np.pi * np.arange(n) / n)).sum()
            return np.angle(phase) * n / (2 * np.pi)

        ox = ((np.arange(w) - centre(0, w) + w / 2) % w - w / 2)[None, :]
        oy = ((np.arange(h) - centre(1, h) + h / 2) % h - h / 2)[:, None]
        moving = weight > 0.2 * weight.max()
        design = np.stack([gx, gy, gy * ox - gx * oy], -1)[moving]
        estimates.append(np.linalg.lstsq(design, -change[moving], rcond=None)[0])
    return np.mean(estimates, 0)


@pytest.fixture(scope="module")
def moves(dataset) -> np.ndarray:
    return np.stack([motion(v) for v in dataset[1]])


def test_single_frames_carry_no_class_information_but_motion_does(dataset, moves):
    _, videos, labels, _ = dataset
    chance = 1 / len(synth.CLASSES)
    for t in (0, videos.shape[1] // 2, videos.shape[1] - 1):
        frames = np.stack([appearance(v[t]) for v in videos])
        assert anova_f(frames, labels).mean() < 2.0
        assert nearest_centroid_loo(frames, labels) < 2 * chance
    assert anova_f(moves, labels).min() > 20
    assert nearest_centroid_loo(moves, labels) >= 0.95


# dominant motion component (0: dx, 1: dy, 2: clockwise spin, image y pointing down) and its sign
DIRECTION = {"move_left": (0, -1), "move_right": (0, 1), "move_up": (1, -1), "move_down": (1, 1),
             "rotate_cw": (2, 1), "rotate_ccw": (2, -1)}


def test_each_class_moves_as_its_name_says(dataset, moves):
    labels = dataset[2]
    for i, label in enumerate(synth.CLASSES):
        mean = moves[labels == i].mean(0) / moves.std(0)
        axis = int(np.argmax(np.abs(mean)))
        assert (axis, int(np.sign(mean[axis]))) == DIRECTION[label], (label, mean)


def test_speed_scale_slows_the_same_videos(dataset, tmp_path):
    """At half the speed, the same video (start, textures) shows at frame 2n what it showed at frame n."""
    out, videos, _, _ = dataset
    synth.synthesize(str(tmp_path), classes=6, train_per_class=1, val_per_class=0, seconds=1.0, workers=2,
                     speed_scale=0.5)
    paths = sorted(tmp_path.rglob("*.mp4"))
    assert len(paths) == 6
    originals = sorted(out.rglob("*.mp4"))
    for path in paths:
        slow, fast = decode_gray(path, 160, 120), videos[originals.index(out / path.relative_to(tmp_path))]
        same = np.abs(slow[0::2] - fast[:5]).mean(axis=(1, 2))
        moved = np.abs(slow[2::2] - fast[2::2]).mean(axis=(1, 2))
        assert same.max() < 1.5 and moved.min() > 2 * same.max(), (path.name, same, moved)
    with pytest.raises(ValueError):
        synth.synthesize(str(tmp_path / "bad"), speed_scale=0.0)


def test_colours_make_colour_x_motion_classes_that_recolour_only_the_disc(tmp_path):
    jobs = synth.plan(str(tmp_path), classes=2, train_per_class=1, val_per_class=1, width=160, height=120,
                      fps=10, seconds=0.4, seed=0, colours=2)
    names = ["red_move_left", "red_move_right", "green_move_left", "green_move_right"]
    assert [os.path.relpath(j.path, tmp_path) for j in jobs] == \
        [f"{split}/{n}/{n}_{split}_0000.mp4" for split in ("train", "val") for n in names]
    assert [(j.colour, j.motion) for j in jobs[:4]] == [("red", "move_left"), ("red", "move_right"),
                                                       ("green", "move_left"), ("green", "move_right")]
    radius = synth.RADIUS * 120
    for job in jobs:
        # the same video drawn with a random disc colour: every other draw (background, disc pattern,
        # path) is the same, so only the disc's pixels differ, and there they show the class's colour
        plain = np.stack(list(synth.render(dataclasses.replace(job, colour=None))))
        coloured = np.stack(list(synth.render(job)))
        for a, b in zip(plain, coloured):
            changed = np.any(a != b, axis=2)
            assert 0.8 * math.pi * radius ** 2 < changed.sum() < math.pi * (radius + 1) ** 2, job.path
            disc = b[changed].astype(np.float64).mean(0)
            assert np.abs(disc - synth.COLOURS[job.colour]).max() < 25, (job.path, disc)


def test_colours_out_of_range_are_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["synth", "--out", str(tmp_path), "--colours", str(len(synth.COLOURS) + 1)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith("argument --colours: 4 is out of range: give 0 to 3")
    with pytest.raises(ValueError):
        synth.synthesize(str(tmp_path), colours=-1)
    assert not os.listdir(tmp_path)
