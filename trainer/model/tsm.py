"""TSM and its 2D baseline TSN: a ResNet over the T frames of a clip, averaged, then a linear head.

The model takes the loader's uint8 clips (B, T, C, H, W) as they are and normalises them
itself, so the float conversion happens wherever the model lives (on the GPU when there is
one). With ``shift=False`` no frame ever sees another before the average: that is TSN.

``modality`` "motion" is two-stream's motion network (``trainer.data.motion``): the same backbone
on the motion fields rendered beside the frames, 2 channels per frame (q of u and of v, 128 = no
motion), its first convolution taking 2 channels and its input normalised as
``(q - 128) / MOTION_STD``: 32 quantisation steps, 5 stored pixels per frame, a fast motion of the
synthetic sets (flow-stream inputs of TSN are scaled alike, to about unit spread). ``load_pretrained``
gives it TSN's cross-modality initialisation from RGB weights.

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

from ..config import BN_MODES, CHANNELS, IMAGENET_MEAN, IMAGENET_STD
from .resnet import NoShift, ResNet
from .subbatch_bn import set_clips_per_group
from .temporal_shift import TemporalShift

log = logging.getLogger(__name__)

MOTION_STD = 32.0  # quantisation steps of shards.motionfield, 0.157 px each
# the loader's uint8 input of each modality: per-channel mean and spread, in units of the third value
NORMALISE = {"rgb": (IMAGENET_MEAN, IMAGENET_STD, 255.0),
             "motion": ((128.0,) * CHANNELS["motion"], (MOTION_STD,) * CHANNELS["motion"], 1.0)}


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
    modality: str = "rgb"  # what each frame is (trainer.config.CHANNELS); checkpoints before it: rgb


class TSM(nn.Module):
    def __init__(self, config: ModelConfig, bn: str = "train", channels_last: bool = False, bn_group: int = 0):
        super().__init__()
        self.config = config
        hook = functools.partial(TemporalShift, config.shift_div) if config.shift else NoShift
        self.backbone = ResNet(config.depth, config.width, hook, CHANNELS[config.modality])
        set_clips_per_group(self.backbone, bn_group)
        self.dropout = nn.Dropout(config.dropout)
        self.fc = nn.Linear(self.backbone.feature_dim, config.num_classes)
        # a fresh head on a (possibly pretrained) backbone starts near zero, as in TSM
        nn.init.normal_(self.fc.weight, 0, 0.001)
        nn.init.zeros_(self.fc.bias)
        mean, std, scale = NORMALISE[config.modality]  # the loader's clips are uint8
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1) * scale, persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1) * scale, persistent=False)
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
    """Load a torchvision-format ResNet state dict (ImageNet weights), or the network of a
    ``checkpoint.pt`` of this project, into the backbone.

    Accepts a bare state dict or one under ``state_dict``/``model``, with or without a
    ``module.`` or ``backbone.`` prefix. The classifier (``fc.*``) is never loaded: the head is new.
    A first convolution of other input channels than the model's (RGB weights for a motion
    network) gets TSN's cross-modality initialisation: the weights averaged over their input
    channels, that mean in every input channel of the model.
    Returns and logs which keys were loaded, which were adapted, which stayed new and which were ignored.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    state = {k.removeprefix("module.").removeprefix("backbone."): v for k, v in state.items()}
    own = model.backbone.state_dict()
    loaded, ignored, adapted = {}, [], []
    for key, value in state.items():
        if key == "conv1.weight" and key in own and value.dim() == 4 and value.shape[1] != own[key].shape[1] \
                and value.shape[:1] + value.shape[2:] == own[key].shape[:1] + own[key].shape[2:]:
            value = value.mean(dim=1, keepdim=True).expand_as(own[key]).clone()
            adapted.append(key)
        if key in own and own[key].shape == value.shape:
            loaded[key] = value
        else:
            ignored.append(key)
    model.backbone.load_state_dict(loaded, strict=False)
    report = {"loaded": sorted(loaded), "new": sorted(k for k in own if k not in loaded) + ["fc.weight", "fc.bias"],
              "ignored": sorted(ignored), "adapted": adapted}
    log.info("pretrained %s: %d tensors loaded, %d new (%s), %d ignored (%s)", path, len(report["loaded"]),
             len(report["new"]), ", ".join(report["new"][:8]), len(ignored), ", ".join(ignored[:8]))
    if adapted:
        log.info("pretrained %s: cross-modality initialisation of conv1 (TSN): its weights over %d input "
                 "channels averaged, the mean in each of the model's %d", path, state["conv1.weight"].shape[1],
                 own["conv1.weight"].shape[1])
    return report
