"""Crop decoding (``csrc/cropjpeg.c`` through ``trainer.cropdecode``): the pixels of a rectangle
decoded alone equal those of a whole-frame decode (PIL, the same libjpeg-turbo) cropped, at
every DCT scale and chroma subsampling; the transforms give the same clips with and without it;
without the library everything still works, and says so."""
from __future__ import annotations

import io
import logging
import random

import numpy as np
import pytest
from PIL import Image

from trainer import cropdecode
from trainer.transforms import EvalTransform, TrainTransform, dct_denom, decode, scaled

# 4:4:4, 4:2:2, 4:2:0 (PIL's subsampling 0, 1, 2); odd sizes leave partial blocks at the edges
SIZES = [(456, 256), (97, 61), (1030, 600)]


def textured_jpeg(w, h, subsampling, seed=0) -> bytes:
    """Smooth colour waves plus noise: every pixel differs from its neighbours, in every channel."""
    rng = np.random.default_rng(seed)
    x, y = np.linspace(0, 6, w)[None, :, None], np.linspace(0, 4, h)[:, None, None]
    a = 127 + 60 * np.sin(3 * x + 2 * y + np.arange(3)) + rng.normal(0, 25, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90, subsampling=subsampling)
    return buf.getvalue()


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


@pytest.mark.parametrize("w,h", [(1024, 768), (340, 256), (600, 900), (2000, 513)])
def test_dct_scale_rule_is_the_one_of_pil_draft(w, h):
    jpeg = textured_jpeg(w, h, 2)
    assert decode(jpeg, 256).size == scaled(w, h, dct_denom(w, h, 256))


@pytest.mark.parametrize("transform", [TrainTransform(112, 128), EvalTransform(112, 128), EvalTransform(112, 96, 3)])
def test_transforms_give_the_same_clips_with_and_without_crop_decoding(transform, monkeypatch, caplog):
    frames = [textured_jpeg(300, 180, 2, seed=t) for t in range(3)]
    with_crops = [transform(frames, random.Random(seed)) for seed in range(6)]
    monkeypatch.setenv("KF_CROPJPEG", "/nonexistent/libcropjpeg.so")
    with caplog.at_level(logging.WARNING, logger="trainer.cropdecode"):
        assert not cropdecode.available()
        whole = [transform(frames, random.Random(seed)) for seed in range(6)]
    assert "crop decoding off, decoding whole frames with PIL" in caplog.text
    for a, b in zip(with_crops, whole):
        assert np.abs(a.astype(int) - b).max() <= 1
