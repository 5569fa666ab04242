"""The motion stream's input and first layer, without a shard set: fields rendered as their frames are, and
TSN's cross-modality initialisation.

Geometry: a frame whose red and green levels encode each pixel's x and y in the stored frame, and a
motion field whose u and v encode each cell's x and y (``shards.format.motionfield``'s PNG). Rendered with
the same random draws, every output pixel of the frame and of the field must then name the same
stored position, through crop, DCT scaling, resize, flip (u negated) and the rescaling of vectors to
output pixels, for training draws and for the 3-crop test views.
"""
from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from helpers.shardsets import make_shardset
from PIL import Image

from shards.format import motionfield
from trainer.config import CHANNELS
from trainer.data import ClipLoader, EpochOptions
from trainer.data.motion import MotionTransform
from trainer.data.shapes import EpochShapes
from trainer.data.transforms import EvalTransform, TrainTransform, dct_denom
from trainer.model.tsm import ModelConfig, build, load_pretrained
from trainer.schedules.multigrid import Schedule, plan

W, H = 128, 96  # the stored frame; 16 x 12 field cells
CX, CY, PER = 64, 48, 4  # a cell's u = (x - CX) / PER, v = (y - CY) / PER: within the stored +-20 px


def _frame_jpeg() -> bytes:
    x, y = np.meshgrid(np.arange(W), np.arange(H))
    pixels = np.dstack([2 * x + 1, 2 * y + 1, np.full_like(x, 128)]).astype(np.uint8)  # 2 levels per pixel
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=100, subsampling=0)
    return buf.getvalue()


def _field_png() -> bytes:
    cols, rows = motionfield.grid_size(W, H)
    xc, yc = np.meshgrid(np.arange(cols) * motionfield.GRID + 4.0, np.arange(rows) * motionfield.GRID + 4.0)
    field = np.dstack([(xc - CX) / PER, (yc - CY) / PER])
    return motionfield.encode(field, np.ones((rows, cols), dtype=bool))


def _positions_agree(frames, fields, g, d: int):
    """Per output pixel, the stored x and y that the frame's levels and the field's vectors name."""
    views_f = frames if frames.ndim == 5 else frames[None]
    views_m = fields if fields.ndim == 5 else fields[None]
    for box, vf, vm in zip(g.boxes, views_f, views_m):
        sx, sy = (box[2] - box[0]) * d / g.side, (box[3] - box[1]) * d / g.side  # stored px per output px
        x_frame, y_frame = (vf[..., 0].astype(float) - 1) / 2, (vf[..., 1].astype(float) - 1) / 2
        u, v = ((vm[..., :2].astype(float) - 128) * motionfield.STEP).transpose(3, 0, 1, 2)
        x_field = CX + PER * u * sx * (-1 if g.flip else 1)
        y_field = CY + PER * v * sy
        # the field is known at cell centres and replicated beyond the outer ones: compare inside them
        inside = (x_frame > 4.5) & (x_frame < W - 4.5) & (y_frame > 4.5) & (y_frame < H - 4.5)
        assert inside.mean() > 0.5
        for name, a, b, s in (("x", x_frame, x_field, sx), ("y", y_frame, y_field, sy)):
            # a JPEG level (half a pixel) and a rounding each to the step of the stored and of the
            # rendered field, which stand for PER and PER * s stored pixels here
            tolerance = 1 + PER * motionfield.STEP * (1 + s)
            err = np.abs(a - b)[inside]
            assert err.max() < tolerance and err.mean() < tolerance / 2, \
                f"{name}: max {err.max():.2f} mean {err.mean():.2f} px (tolerance {tolerance:.2f}), {g}"


@pytest.mark.parametrize("scale_size", [48, 96])  # DCT-scaled 1/2, and as stored
def test_training_crops_flips_and_resizes_agree_for_frames_and_fields(scale_size):
    jpeg, png = _frame_jpeg(), _field_png()
    d = dct_denom(W, H, scale_size)
    assert d == (2 if scale_size == 48 else 1)
    rgb = TrainTransform(crop_size=32, scale_size=scale_size, flip=True)
    motion = MotionTransform(TrainTransform(crop_size=32, scale_size=scale_size, flip=True), "mv")
    flips = set()
    for seed in range(12):
        frames = np.empty(rgb.shape(2), dtype=np.uint8)
        fields = np.empty(motion.shape(2), dtype=np.uint8)
        g = rgb.into([jpeg, jpeg], random.Random(seed), frames)
        assert motion.into([(jpeg, png), (jpeg, png)], random.Random(seed), fields) == g
        assert fields.shape == (2, 32, 32, 2)
        _positions_agree(frames, fields, g, d)
        flips.add(g.flip)
    assert flips == {False, True}


def test_the_three_test_views_agree_for_frames_and_fields():
    jpeg, png = _frame_jpeg(), _field_png()
    rgb, motion = EvalTransform(32, 64, crops=3), MotionTransform(EvalTransform(32, 64, crops=3), "mv")
    frames, fields = np.empty(rgb.shape(1), dtype=np.uint8), np.empty(motion.shape(1), dtype=np.uint8)
    g = rgb.into([jpeg], None, frames)
    assert motion.into([(jpeg, png)], None, fields) == g and fields.shape == (3, 1, 64, 64, 2)
    _positions_agree(frames, fields, g, dct_denom(W, H, 64))


def test_u_is_negated_under_a_flip():
    """A uniform field: the flip mirrors nothing visible, so only the sign of u tells."""
    cols, rows = motionfield.grid_size(W, H)
    png = motionfield.encode(np.dstack([np.full((rows, cols), 3.0), np.full((rows, cols), -2.0)]),
                             np.ones((rows, cols), dtype=bool))
    jpeg = _frame_jpeg()
    motion = MotionTransform(TrainTransform(crop_size=48, scale_size=96, flip=True), "mv")
    seen = {}
    for seed in range(8):
        out = np.empty(motion.shape(1), dtype=np.uint8)
        g = motion.into([(jpeg, png)], random.Random(seed), out)
        sx, sy = (g.boxes[0][2] - g.boxes[0][0]) / 48, (g.boxes[0][3] - g.boxes[0][1]) / 48
        u, v = (out[0, ..., 0].astype(float)
                - 128) * motionfield.STEP, (out[0, ..., 1].astype(float) - 128) * motionfield.STEP
        assert np.abs(u - (-3.0 if g.flip else 3.0) / sx).max() <= 1.5 * motionfield.STEP
        assert np.abs(v - (-2.0 / sy)).max() <= 1.5 * motionfield.STEP
        seen[g.flip] = True
    assert set(seen) == {False, True}


def _rgb_network_file(tmp_path, wrap: bool):
    """A tiny RGB TSM saved as this project's checkpoint.pt does (under "model", ``backbone.`` keys), or
    as a torchvision-format ResNet state dict."""
    torch.manual_seed(1)
    rgb = build(ModelConfig(num_classes=5, segments=2, depth=10, width=8))
    path = tmp_path / ("checkpoint.pt" if wrap else "resnet.pth")
    torch.save({"model": rgb.state_dict()} if wrap else rgb.backbone.state_dict(), path)
    return rgb, str(path)


@pytest.mark.parametrize("wrap", [True, False], ids=["rgb-checkpoint", "torchvision-format"])
def test_cross_modality_initialisation_averages_the_rgb_first_layer(tmp_path, wrap):
    rgb, path = _rgb_network_file(tmp_path, wrap)
    motion = build(ModelConfig(num_classes=4, segments=2, depth=10, width=8, modality="motion"))
    report = load_pretrained(motion, path)
    assert report["adapted"] == ["conv1.weight"] and "conv1.weight" in report["loaded"]
    first = motion.backbone.conv1.weight
    assert first.shape == (8, 2, 7, 7)
    expected = rgb.backbone.conv1.weight.mean(dim=1)
    for c in range(2):
        assert torch.equal(first[:, c], expected)
    assert torch.equal(motion.backbone.layer4[0].conv2.weight, rgb.backbone.layer4[0].conv2.weight)
    assert torch.equal(motion.backbone.bn1.running_mean, rgb.backbone.bn1.running_mean)
    assert "fc.weight" in report["new"] and motion.fc.weight.shape == (4, 8 * 8)


def test_a_motion_network_takes_two_channels_normalised_around_128():
    """What ``forward`` hands its first convolution, seen by a hook there: a still field (128 in
    both channels) is zero, and a field of 128 + 32 k is k (one unit per 32 quantisation steps,
    ``MOTION_STD``) in that channel, frame by frame; an RGB clip does not fit."""
    motion = build(ModelConfig(num_classes=3, segments=2, depth=10, width=8, modality="motion")).eval()
    seen = []
    motion.backbone.conv1.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    still = torch.full((1, 2, 2, 32, 32), 128, dtype=torch.uint8)
    moving = still.clone()
    moving[0, 0, 0], moving[0, 1, 1] = 128 + 64, 128 - 96  # u of frame 0: +2 units; v of frame 1: -3
    with torch.no_grad():
        assert motion(still).shape == (1, 3) and motion(moving).shape == (1, 3)
        assert torch.equal(seen[0], torch.zeros(2, 2, 32, 32))
        expect = torch.zeros(2, 2, 32, 32)
        expect[0, 0], expect[1, 1] = 2.0, -3.0
        assert torch.equal(seen[1], expect)
        with pytest.raises(RuntimeError):
            motion(torch.zeros((1, 2, 3, 32, 32), dtype=torch.uint8))


def test_the_multigrid_loader_renders_motion_parts_in_the_order_and_draws_of_the_rgb_loader(tmp_path):
    """Multigrid (parts of fewer frames and smaller crops) through ``ClipLoader``: the motion loader
    yields the RGB loader's clips in the same order, each part 2 channels per frame, every k-th stored
    field taken (u grows with the stored frame), u's sign the flip's, v the same in every frame."""
    stored = 8
    make_shardset(str(tmp_path), {"train": 12}, per_shard=5, frames=stored, motion="mv")
    sched = Schedule(plan(2, (1,), stored, 32, long_cycle=True, short_cycle=True), batch=1, world_size=1,
                     samples=12)

    def batches(modality: str):
        shapes = EpochShapes(sched, CHANNELS[modality])
        loader = ClipLoader(str(tmp_path), "train", EpochOptions(batch_size=1, shuffle_buffer=4,
                                                                 shapes=shapes),
                            num_workers=0, crop_size=32, scale_size=48, flip=True, modality=modality)
        return list(loader)

    rgb, motion = batches("rgb"), batches("motion")
    assert [b["keys"] for b in rgb] == [b["keys"] for b in motion]
    assert len({tuple(p["clips"].shape) for b in motion for p in b["parts"]}) > 1
    signs = set()
    for batch in motion:
        for part in batch["parts"]:
            clips = part["clips"]
            assert clips.shape[2] == 2 and clips.shape[1] < stored or clips.shape[1] == stored
            for clip, key in zip(clips.numpy(), part["keys"]):
                u, v = clip[:, 0].astype(int) - 128, clip[:, 1].astype(int) - 128
                assert (u == u[:, :1, :1]).all() and (v == v[:, :1,
                                                             :1]).all(), "a uniform field stays uniform"
                sign = np.sign(u[0, 0, 0])
                magnitudes = sign * u[:, 0, 0]
                assert sign != 0 and (np.diff(magnitudes) > 0).all(), f"{key}: u by frame {u[:, 0, 0]}"
                assert len(set(v[:, 0, 0])) == 1
                signs.add(int(sign))
    assert signs == {-1, 1}
