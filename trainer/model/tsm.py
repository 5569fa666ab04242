"""TSM and its 2D baseline TSN: a ResNet over the T frames of a clip, averaged, then a linear head.

The model takes the loader's uint8 clips (B, T, C, H, W) as they are and normalises them
itself, so the float conversion happens wherever the model lives (on the GPU when there is
one). With ``shift=False`` no frame ever sees another before the average: that is TSN.

``segments`` is the T the network is built and evaluated for; training batches may have fewer
frames per clip (multigrid's shorter clips): the shift and the BN groups follow the T of each
batch. ``bn_group`` clips per BN statistics group (0: the whole batch) is a training choice, not
part of the architecture or the checkpoint (see ``trainer.model.subbatch_bn``).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..config import BN_MODES
from .resnet import NoShift, ResNet
from .subbatch_bn import set_clips_per_group
from .temporal_shift import TemporalShift

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class ModelConfig:
    """Everything needed to rebuild the network; stored in every checkpoint. ``segments`` (T) has
    no default: a network built or called without its frames per clip would be TSN in disguise."""
    num_classes: int
    segments: int
    depth: int = 50
    width: int = 64
    shift: bool = True
    shift_div: int = 8
    dropout: float = 0.0


class TSM(nn.Module):
    def __init__(self, config: ModelConfig, bn: str = "train", channels_last: bool = False, bn_group: int = 0):
        super().__init__()
        self.config = config
        hook = functools.partial(TemporalShift, config.shift_div) if config.shift else NoShift
        self.backbone = ResNet(config.depth, config.width, hook)
        set_clips_per_group(self.backbone, bn_group)
        self.dropout = nn.Dropout(config.dropout)
        self.fc = nn.Linear(self.backbone.feature_dim, config.num_classes)
        # a fresh head on a (possibly pretrained) backbone starts near zero, as in TSM
        nn.init.normal_(self.fc.weight, 0, 0.001)
        nn.init.zeros_(self.fc.bias)
        scale = 255.0  # the loader's clips are uint8
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * scale, persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * scale, persistent=False)
        self.channels_last = channels_last
        if bn not in BN_MODES:
            raise ValueError(f"bn mode {bn!r} not one of {BN_MODES}")
        self.bn = bn
        for layer in self.frozen_bns():
            layer.weight.requires_grad_(False)
            layer.bias.requires_grad_(False)

    def frozen_bns(self) -> list[nn.BatchNorm2d]:
        """BN layers that keep their (pretrained) statistics and affine parameters."""
        layers = [m for m in self.backbone.modules() if isinstance(m, nn.BatchNorm2d)]
        return {"train": [], "partial": layers[1:], "frozen": layers}[self.bn]

    def train(self, mode: bool = True) -> "TSM":
        super().train(mode)
        if mode:
            for layer in self.frozen_bns():
                layer.eval()
        return self

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        """(B, T, C, H, W) uint8 or float in [0, 255] -> class scores (B, num_classes); T at most
        the ``segments`` the model is built for."""
        b, t = clips.shape[:2]
        if t > self.config.segments:
            raise ValueError(f"model built for {self.config.segments} frames per clip, got {t}")
        x = (clips.flatten(0, 1).float() - self.mean) / self.std
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        features = self.backbone(x, t).view(b, t, -1).mean(dim=1)  # average consensus
        return self.fc(self.dropout(features))


def build(config: ModelConfig | dict, **kwargs) -> TSM:
    if isinstance(config, dict):
        config = ModelConfig(**config)
    return TSM(config, **kwargs)


def load_pretrained(model: TSM, path: str) -> dict:
    """Load a torchvision-format ResNet state dict (ImageNet weights) into the backbone.

    Accepts a bare state dict or one under ``state_dict``/``model``, with or without a
    ``module.`` prefix. The classifier (``fc.*``) is never loaded: the head is new.
    Returns and logs which keys were loaded, which stayed new and which were ignored.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    state = {k.removeprefix("module."): v for k, v in state.items()}
    own = model.backbone.state_dict()
    loaded, ignored = {}, []
    for key, value in state.items():
        if key in own and own[key].shape == value.shape:
            loaded[key] = value
        else:
            ignored.append(key)
    model.backbone.load_state_dict(loaded, strict=False)
    report = {"loaded": sorted(loaded), "new": sorted(k for k in own if k not in loaded) + ["fc.weight", "fc.bias"],
              "ignored": sorted(ignored)}
    log.info("pretrained %s: %d tensors loaded, %d new (%s), %d ignored (%s)", path, len(report["loaded"]),
             len(report["new"]), ", ".join(report["new"][:8]), len(ignored), ", ".join(ignored[:8]))
    return report
