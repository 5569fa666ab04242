"""Decoding on the device: the loader hands out JPEG bytes plus geometry, ``DeviceClips`` makes clips.

These machines have no GPU and no torchvision, so nvJPEG is replaced by PIL decoding into
tensors (``DeviceClips(decode=...)``); everything else (header parsing and random draws in the
workers, the batch packing, the crop/resize/flip in torch) is the code a GPU run uses. The
clips must match CPU decoding crop for crop. Where a CUDA GPU and torchvision are present the
same comparison also runs with real nvJPEG.
"""
from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from shards.format.manifest import Manifest, SplitInfo
from shards.format.packing import shard_name, write_shard
from shards.format.tar import sample_bytes
from trainer.data import ClipLoader, EpochOptions
from trainer.data.device_decode import DeviceClips, resized_crop

FRAMES, W, H = 4, 96, 64


def textured_jpeg(sample: int, frame: int) -> bytes:
    """A frame whose every crop and flip looks different: ramps in x and y, per-sample tint."""
    x = np.linspace(0, 200, W)[None, :, None]
    y = np.linspace(0, 50, H)[:, None, None]
    tint = np.array([sample * 7 % 40, frame * 10, 20])[None, None, :]
    buf = io.BytesIO()
    Image.fromarray(np.clip(x + y + tint, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("textured"))
    samples = []
    for i in range(12):
        key = f"vid{i:03d}_c00"
        members = [(f"{t:02d}.jpg", textured_jpeg(i, t)) for t in range(FRAMES)]
        samples.append((key, i % 2, sample_bytes(key, members + [("cls", str(i % 2).encode()),
                                                                 ("json", b"{}")])))
    shards = [write_shard(os.path.join(d, shard_name("train", k)), shard_name("train", k),
                          samples[k * 6:(k + 1) * 6])
              for k in range(2)]
    Manifest(classes=["a", "b"], splits={"train": SplitInfo(shards)}, fingerprint="textured").save(d)
    return d


def pil_decode(datas: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stands in for nvJPEG: encoded uint8 tensors -> decoded (C, H, W) uint8 tensors."""
    return [torch.from_numpy(np.array(Image.open(io.BytesIO(d.numpy().tobytes())).convert("RGB")))
            .permute(2, 0, 1) for d in datas]


def both_paths(shardset, train: bool | None = None, **kw):
    epochs, args = EpochOptions(batch_size=3, seed=5,
                                train=train), dict(num_workers=1, crop_size=40, scale_size=48) | kw
    on_cpu = list(ClipLoader(shardset, "train", epochs, **args))
    raw = list(ClipLoader(shardset, "train", epochs, decode_on_device=True, **args))
    return on_cpu, raw


NVJPEG = pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("torchvision")),
                            reason="real nvJPEG needs a CUDA GPU and torchvision")


@pytest.mark.parametrize("decoder", ["pil-stand-in", pytest.param("nvjpeg", marks=NVJPEG)])
@pytest.mark.parametrize("train,crops", [(True, 1), (False, 1), (False, 3)])
def test_device_clips_match_cpu_decoding(shardset, train, crops, decoder):
    on_cpu, raw = both_paths(shardset, train=train, eval_crops=crops)
    to_clips = DeviceClips("cpu", decode=pil_decode) if decoder == "pil-stand-in" else DeviceClips("cuda")
    assert len(raw) == len(on_cpu) == 4
    flips = 0
    for a, b in zip(on_cpu, raw):
        assert "clips" not in b and b["keys"] == a["keys"] and torch.equal(b["labels"], a["labels"])
        flips += int(b["flip"].sum())
        clips = to_clips(b).cpu()
        assert clips.shape == a["clips"].shape and clips.dtype == torch.uint8
        diff = (clips.int() - a["clips"].int()).abs().float()
        assert diff.mean() < 1 and diff.max() <= 4  # resize rounding only: a wrong crop or flip is 40+ off
    assert (flips > 0) == train


def test_resized_crop_crops_resizes_and_flips():
    clip = torch.arange(2 * 3 * 8 * 10, dtype=torch.uint8).view(2, 3, 8, 10)
    assert torch.equal(resized_crop(clip, (2, 1, 6, 5), 4, False), clip[:, :, 1:5, 2:6])
    assert torch.equal(resized_crop(clip, (2, 1, 6, 5), 4, True), clip[:, :, 1:5, 2:6].flip(-1))
    assert resized_crop(clip, (0, 0, 8, 8), 4, False).shape == (2, 3, 4, 4)


def test_workers_send_bytes_not_pixels(shardset):
    _, raw = both_paths(shardset)
    b = raw[0]
    offsets = b["jpeg_offsets"].tolist()
    assert len(offsets) == 3 * FRAMES + 1 and offsets[-1] == len(b["jpeg_data"])
    first = b["jpeg_data"][offsets[0]:offsets[1]].numpy().tobytes()
    assert first[:2] == b"\xff\xd8" and Image.open(io.BytesIO(first)).size == (W, H)
    assert b["boxes"].shape == (3, 1, 4) and b["side"] == 40 and b["frames"] == FRAMES


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="torchvision is installed here")
def test_without_torchvision_the_trainer_says_what_is_missing(shardset, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--data", shardset, "--val-split", "",
                           "--backend", "none", "--depth", "10", "--width", "8", "--segments", str(FRAMES),
                           "--decode-on-device", "--output-dir", str(tmp_path)], capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "--decode-on-device needs torchvision" in proc.stderr
