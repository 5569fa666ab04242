"""Crop decoding (``csrc/cropjpeg.c`` through ``trainer.data.cropdecode``): the pixels of a rectangle
decoded alone equal those of a whole-frame decode (PIL, the same libjpeg-turbo) cropped, at
every DCT scale and chroma subsampling, with and without restart markers (with them, only the
restart intervals under the rectangle are decoded: the data around it is never read); broken
files give clear errors; the transforms give the same clips with and without it; without the
library everything still works, and says so."""
from __future__ import annotations

import io
import logging
import random

import numpy as np
import pytest
from PIL import Image

from ingest.jpeg import restart_interval
from trainer.data import cropdecode
from trainer.data.transforms import EvalTransform, TrainTransform, dct_denom, decode, scaled

# 4:4:4, 4:2:2, 4:2:0 (PIL's subsampling 0, 1, 2); odd sizes leave partial blocks at the edges
SIZES = [(456, 256), (97, 61), (1030, 600)]


def textured_jpeg(w, h, subsampling, seed=0, restart=0) -> bytes:
    """Smooth colour waves plus noise: every pixel differs from its neighbours, in every channel;
    a restart marker every ``restart`` MCUs (0: none)."""
    rng = np.random.default_rng(seed)
    x, y = np.linspace(0, 6, w)[None, :, None], np.linspace(0, 4, h)[:, None, None]
    a = 127 + 60 * np.sin(3 * x + 2 * y + np.arange(3)) + rng.normal(0, 25, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90,
                                                              subsampling=subsampling,
                                                              restart_marker_blocks=restart)
    return buf.getvalue()


def whole_frame(jpeg: bytes, d: int) -> np.ndarray:
    """The frame decoded whole by PIL at 1/d."""
    img = Image.open(io.BytesIO(jpeg))
    if d > 1:
        img.draft("RGB", (img.size[0] // d, img.size[1] // d))
    return np.asarray(img.convert("RGB")).astype(int)


def rectangles(rng: random.Random, w: int, h: int, n: int):
    """``n`` random rectangles (left, top, right, bottom), then thin ones along every edge, the
    corners' pixels and the whole frame."""
    for _ in range(n):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        yield x0, y0, rng.randrange(x0 + 1, w + 1), rng.randrange(y0 + 1, h + 1)
    yield from [(0, 0, w, 1), (0, h - 1, w, h), (0, 0, 1, h), (w - 1, 0, w, h),
                (0, 0, 1, 1), (w - 1, h - 1, w, h), (0, 0, w, h)]


@pytest.fixture(autouse=True)
def library():
    if not cropdecode.available():
        pytest.fail("trainer/libcropjpeg.so is not built: run scripts/build-native.sh")


def test_a_decoded_rectangle_equals_the_whole_frame_cropped():
    rng, worst, checked = random.Random(0), 0, 0
    for w, h in SIZES:
        for subsampling in (0, 1, 2):
            jpeg = textured_jpeg(w, h, subsampling)
            for d in (1, 2, 4, 8):
                img = Image.open(io.BytesIO(jpeg))
                if d > 1:
                    img.draft("RGB", (w // d, h // d))
                whole = np.asarray(img.convert("RGB")).astype(int)
                assert cropdecode.scaled_size(jpeg, d) == scaled(w, h, d) == whole.shape[1::-1]
                sw, sh = scaled(w, h, d)
                for _ in range(12):
                    x0, y0 = rng.randrange(sw), rng.randrange(sh)
                    x1, y1 = rng.randrange(x0 + 1, sw + 1), rng.randrange(y0 + 1, sh + 1)
                    got = cropdecode.decode_crop(jpeg, (x0, y0, x1, y1), d)
                    worst = max(worst, int(np.abs(got - whole[y0:y1, x0:x1]).max()))
                    checked += 1
    assert checked == 432 and worst <= 1, f"largest difference {worst} levels"


def test_decoding_into_strided_rows_and_bad_input():
    jpeg = textured_jpeg(97, 61, 2)
    whole = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
    canvas = np.zeros((40, 50, 3), np.uint8)
    cropdecode.decode_crop(jpeg, (10, 5, 30, 25), 1, canvas[3:23, 7:27])
    assert np.array_equal(canvas[3:23, 7:27], whole[5:25, 10:30]) and not canvas[:3].any()
    with pytest.raises(ValueError, match="outside the 97x61 frame"):
        cropdecode.decode_crop(jpeg, (90, 0, 98, 10))
    with pytest.raises(ValueError, match="JPEG decode: Not a JPEG file"):
        cropdecode.decode_crop(b"GIF89a" + jpeg[6:], (0, 0, 8, 8))


def mcus_per_row(w: int, subsampling: int) -> int:
    return -(-w // (8 if subsampling == 0 else 16))


def test_restart_intervals_decode_alone_and_equal_the_whole_frame_cropped():
    """Intervals of one MCU, of several tiling each row, of a whole row, and of a length that
    does not tile the rows (decoded the ordinary way), at every scale and subsampling."""
    rng, worst, checked = random.Random(1), 0, 0
    for w, h in [(456, 256), (97, 61), (250, 130)]:
        for subsampling in (0, 1, 2):
            per_row = mcus_per_row(w, subsampling)
            tiling = next(n for n in range(2, per_row + 1) if per_row % n == 0)
            untiling = next(n for n in range(2, per_row) if per_row % n)
            for restart in sorted({1, tiling, per_row, untiling}):
                jpeg = textured_jpeg(w, h, subsampling, restart=restart)
                for d in (1, 2, 4, 8):
                    whole = whole_frame(jpeg, d)
                    for x0, y0, x1, y1 in rectangles(rng, whole.shape[1], whole.shape[0], 3):
                        got = cropdecode.decode_crop(jpeg, (x0, y0, x1, y1), d)
                        worst = max(worst, int(np.abs(got - whole[y0:y1, x0:x1]).max()))
                        checked += 1
    assert checked == 1240 and worst == 0, f"largest difference {worst} levels"


def intervals(jpeg: bytes) -> list[tuple[int, int]]:
    """Byte ranges of the entropy data of each restart interval."""
    start = jpeg.index(b"\xff\xda")
    start += 2 + int.from_bytes(jpeg[start + 2:start + 4], "big")
    found, i = [], start
    while True:
        i = jpeg.index(b"\xff", i)
        if jpeg[i + 1] == 0:
            i += 2
            continue
        found.append((start, i))
        if not 0xD0 <= jpeg[i + 1] <= 0xD7:
            return found
        start = i = i + 2


def test_only_the_intervals_under_the_rectangle_are_decoded():
    """What is decoded is a valid JPEG of the MCUs under the rectangle and one chroma sample of
    context around it, the intervals copied byte for byte; its pixels there are the frame's."""
    jpeg = textured_jpeg(456, 256, 2, restart=1)  # 29 x 16 MCUs of 16 x 16 pixels, 4:2:0
    whole = whole_frame(jpeg, 1)
    small, (x, y) = cropdecode.cut(jpeg, (100, 40, 300, 200))
    img = Image.open(io.BytesIO(small))
    assert img.size == (13 * 16, 11 * 16) and (x, y) == (100 - 6 * 16, 40 - 2 * 16)  # MCUs 6-18 x 2-12
    assert len(small) < 0.33 * len(jpeg) and restart_interval(small) == 1  # 143 of 464 MCUs
    assert np.array_equal(np.asarray(img.convert("RGB"))[y:y + 160, x:x + 200], whole[40:200, 100:300])
    cuts = intervals(jpeg)
    first, last = cuts[2 * 29 + 6], cuts[12 * 29 + 18]
    assert jpeg[first[0]:first[1]] in small and jpeg[last[0]:last[1]] in small
    small, (x, y) = cropdecode.cut(jpeg, (56, 0, 57, 3), 8)  # 1/8 scale (57 x 32): 2 pixels per MCU
    # 3 columns at least
    assert Image.open(io.BytesIO(small)).size == (456 - 26 * 16, 3 * 16) and (x, y) == (4, 0)
    assert cropdecode.cut(jpeg, (0, 0, 456, 256)) is None  # every interval: decoded whole
    assert cropdecode.cut(textured_jpeg(456, 256, 2, restart=2), (100, 40, 300, 200)) is None  # 29 MCUs a row


def test_broken_files_give_clear_errors():
    jpeg = textured_jpeg(456, 256, 2, restart=1)
    cuts = intervals(jpeg)
    box = (300, 150, 400, 250)  # needs MCU rows 9-15, columns 18-25: up to interval 15 x 29 + 25
    truncated = jpeg[:cuts[29 * 12][0]]
    with pytest.raises(ValueError,
                       match="JPEG decode: entropy data truncated in restart interval 349 of 461 needed"):
        cropdecode.decode_crop(truncated, box)
    cropdecode.decode_crop(truncated, (0, 0, 100, 100))  # what is there still decodes
    a, b = cuts[100][1], cuts[101][0]  # RST3 after interval 100
    with pytest.raises(ValueError, match=r"RST5 at byte \d+ where RST4 was expected \(a marker is missing\)"):
        cropdecode.decode_crop(jpeg[:a] + jpeg[b:], box)
    eoi_early = jpeg[:cuts[200][1]] + b"\xff\xd9"
    with pytest.raises(ValueError, match="entropy data ends after 201 restart intervals, 461 needed"):
        cropdecode.decode_crop(eoi_early, box)
    with pytest.raises(ValueError, match="JPEG decode: .*"):
        cropdecode.decode_crop(jpeg[:300], box)  # inside the headers: libjpeg's own message
    with pytest.raises(ValueError, match="outside the 456x256 frame"):
        cropdecode.decode_crop(jpeg, (400, 0, 457, 10))


@pytest.mark.parametrize("w,h", [(1024, 768), (340, 256), (600, 900), (2000, 513)])
def test_dct_scale_rule_is_the_one_of_pil_draft(w, h):
    jpeg = textured_jpeg(w, h, 2)
    assert decode(jpeg, 256).size == scaled(w, h, dct_denom(w, h, 256))


@pytest.mark.parametrize("transform", [TrainTransform(112, 128), EvalTransform(112, 128),
                                       EvalTransform(112, 96, 3)])
def test_transforms_give_the_same_clips_with_and_without_crop_decoding(transform, monkeypatch, caplog):
    frames = [textured_jpeg(300, 180, 2, seed=t, restart=t % 2) for t in range(3)]  # cut or not
    with_crops = [transform(frames, random.Random(seed)) for seed in range(6)]
    monkeypatch.setenv("KF_CROPJPEG", "/nonexistent/libcropjpeg.so")
    with caplog.at_level(logging.WARNING, logger="trainer.data.cropdecode"):
        assert not cropdecode.available()
        whole = [transform(frames, random.Random(seed)) for seed in range(6)]
    assert "crop decoding off, decoding whole frames with PIL" in caplog.text
    for a, b in zip(with_crops, whole):
        assert np.abs(a.astype(int) - b).max() <= 1
