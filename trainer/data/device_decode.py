"""Decoding the loader's JPEG bytes on the GPU, so the CPU only reads bytes (``--decode-on-device``).

With ``ClipLoader(decode_on_device=True)`` loader workers parse JPEG headers and draw each
clip's geometry (crop boxes, output side, flip: the same random draws as CPU decoding), and
batches carry the undecoded bytes. ``DeviceClips`` turns such a batch into the clips CPU
decoding would have given, (B, T, C, H, W) uint8, or (B, V, T, C, H, W) for several views:
nvJPEG decodes all B x T frames of the batch in one call (``torchvision.io.decode_jpeg`` on a
CUDA device), then every clip is cropped, resized (bilinear, antialiased) and flipped there.

Two differences from CPU decoding, both small: frames are decoded at full size (no DCT
downscaling, which nvJPEG does not need), and torch's antialiased bilinear resize differs from
the CPU path's (OpenCV's bilinear, PIL's for fractional boxes) by a level or two on average.
The crops themselves are identical.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.nn.functional as F

from shards.base.errors import UsageError

Decoder = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def nvjpeg(device: torch.device) -> Decoder:
    """Batched JPEG decoding with torchvision (nvJPEG on CUDA devices): encoded uint8 tensors on
    the CPU in, (C, H, W) uint8 RGB tensors on ``device`` out."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as e:
        raise UsageError(f"--decode-on-device needs torchvision ({e}); it comes with CUDA builds of "
                         "PyTorch, not with the CPU-only build of these machines") from None
    return lambda datas: decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)


def resized_crop(clip: torch.Tensor, box, side: int, flip: bool) -> torch.Tensor:
    """(T, C, H, W) uint8 -> (T, C, side, side) uint8: ``box`` (left, top, right, bottom) cropped,
    resized unless it already has the output size, and mirrored when ``flip``."""
    x0, y0, x1, y1 = (round(v) for v in box)
    crop = clip[:, :, y0:y1, x0:x1]
    if (x1 - x0, y1 - y0) != (side, side):
        crop = F.interpolate(crop.float(), size=(side, side), mode="bilinear", align_corners=False,
                             antialias=True).round_().clamp_(0, 255).to(torch.uint8)
    return crop.flip(-1) if flip else crop


class DeviceClips:
    """Callable: a ``decode_on_device`` batch -> clips on ``device``. ``decode`` replaces nvJPEG
    (any function from encoded tensors to decoded (C, H, W) tensors)."""

    def __init__(self, device: torch.device | str, decode: Decoder | None = None):
        self.device = torch.device(device)
        self.decode = decode or nvjpeg(self.device)

    def __call__(self, batch: dict) -> torch.Tensor:
        data, offsets = batch["jpeg_data"], batch["jpeg_offsets"].tolist()
        frames = self.decode([data[a:b] for a, b in zip(offsets, offsets[1:])])
        t, side = batch["frames"], batch["side"]
        clips = []
        for i, (boxes, flip) in enumerate(zip(batch["boxes"].tolist(), batch["flip"].tolist())):
            clip = torch.stack(frames[i * t:(i + 1) * t]).to(self.device, non_blocking=True)
            views = [resized_crop(clip, box, side, flip) for box in boxes]
            clips.append(views[0] if len(views) == 1 else torch.stack(views))
        return torch.stack(clips)


def clip_source(decode_on_device: bool, device: torch.device) -> Callable[[dict], torch.Tensor]:
    """How the training and test loops get a batch's clips: decoded by the loader, or here."""
    return DeviceClips(device) if decode_on_device else operator.itemgetter("clips")
