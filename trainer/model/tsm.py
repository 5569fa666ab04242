"""The video networks: TSM, its 2D baseline TSN, and the I3D baselines: a ResNet over the T frames of
a clip, averaged over time, then a linear head.

The model takes the loader's uint8 clips (B, T, C, H, W) as they are and normalises them
itself, so the float conversion happens wherever the model lives (on the GPU when there is
one). ``arch`` (``trainer.config.ARCHS``) picks the backbone: ``tsm``, a 2D ResNet with the temporal
shift in every residual branch; ``tsn``, the same without it (no frame ever sees another before the
average); ``i3d-3x3x3`` and ``i3d-3x1x1``, the ResNet inflated to 3D (``trainer.model.i3d``), whose
features of the time steps left after its temporal pooling are averaged the same way (the global
average pool of the I3D papers). Checkpoints written before ``arch`` name the network by ``shift``
(True: TSM, False: TSN), which ``ModelConfig`` still reads.

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

from ..config import BN_MODES, CHANNELS, IMAGENET_MEAN, IMAGENET_STD, architecture
from .i3d import INFLATIONS, inflate
from .resnet import NoShift, ResNet
from .subbatch_bn import set_clips_per_group
from .temporal_shift import TemporalShift

log = logging.getLogger(__name__)

MOTION_STD = 32.0  # quantisation steps of shards.format.motionfield, 0.157 px each
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
    shift: bool | None = None  # the temporal shift, i.e. arch tsm (None: as arch says)
    shift_div: int = 8
    dropout: float = 0.0
    modality: str = "rgb"  # what each frame is (trainer.config.CHANNELS); checkpoints before it: rgb
    # trainer.config.ARCHS (None: tsm, or tsn with shift False); checkpoints before it: None
    arch: str | None = None

    def __post_init__(self):
        self.arch = architecture(self.arch, self.shift)  # ValueError for arch tsm with shift False
        self.shift = self.arch == "tsm"


class VideoNet(nn.Module):
    """``config``'s network; ``bn``: ``trainer.config.BN_MODES``; ``channels_last``: NHWC activations
    (NDHWC in an I3D); ``bn_group``: clips per BN statistics group in training (0: the batch)."""

    def __init__(self, config: ModelConfig, bn: str = "train", channels_last: bool = False,
                 bn_group: int = 0):
        super().__init__()
        self.config = config
        hook = functools.partial(TemporalShift, config.shift_div) if config.shift else NoShift
        self.backbone = ResNet(config.depth, config.width, hook, CHANNELS[config.modality],
                               INFLATIONS.get(config.arch))
        set_clips_per_group(self.backbone, bn_group)
        self.dropout = nn.Dropout(config.dropout)
        self.fc = nn.Linear(self.backbone.feature_dim, config.num_classes)
        # a fresh head on a (possibly pretrained) backbone starts near zero, as in TSM
        nn.init.normal_(self.fc.weight, 0, 0.001)
        nn.init.zeros_(self.fc.bias)
        mean, std, scale = NORMALISE[config.modality]  # the loader's clips are uint8
        # (C, 1, 1), broadcast over frames (N*T, C, H, W); not 4D, which Module.to(memory_format=)
        # would convert
        self.register_buffer("mean", torch.tensor(mean).view(-1, 1, 1) * scale, persistent=False)
        self.register_buffer("std", torch.tensor(std).view(-1, 1, 1) * scale, persistent=False)
        self.channels_last = channels_last
        # what Module.to(memory_format=) takes for this network's weights
        self.memory_format = (torch.channels_last_3d if self.backbone.inflation else torch.channels_last) \
            if channels_last else torch.preserve_format
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

    def train(self, mode: bool = True) -> "VideoNet":
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
        # average consensus over the time steps the backbone leaves (T, or fewer in an I3D)
        features = self.backbone(x, t).view(b, -1, self.backbone.feature_dim).mean(dim=1)
        return self.fc(self.dropout(features))


def build(config: ModelConfig | dict, **kwargs) -> VideoNet:
    if isinstance(config, dict):
        config = ModelConfig(**config)
    return VideoNet(config, **kwargs)


def load_pretrained(model: VideoNet, path: str) -> dict:
    """Load a torchvision-format ResNet state dict (ImageNet weights), or the network of a
    ``checkpoint.pt`` of this project, into the backbone.

    Accepts a bare state dict or one under ``state_dict``/``model``, with or without a
    ``module.`` or ``backbone.`` prefix. The classifier (``fc.*``) is never loaded: the head is new.
    A first convolution of other input channels than the model's (RGB weights for a motion
    network) gets TSN's cross-modality initialisation: the weights averaged over their input
    channels, that mean in every input channel of the model. An I3D gets 2D kernels inflated
    (``trainer.model.i3d.inflate``): each repeated over its convolution's temporal size t and divided
    by t, as Carreira and Zisserman initialise from ImageNet.
    Returns and logs which keys were loaded, which were inflated or adapted, which stayed new and which
    were ignored.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    state = {k.removeprefix("module.").removeprefix("backbone."): v for k, v in state.items()}
    own = model.backbone.state_dict()
    loaded, ignored, adapted, inflated = {}, [], [], []
    for key, value in state.items():
        target = own.get(key)
        if (target is not None and value.dim() == 4 and target.dim() == 5
                and value.shape[2:] == target.shape[3:]):
            value = inflate(value, target.shape[2])
            inflated.append(key)
        if key == "conv1.weight" and target is not None and value.shape[1] != target.shape[1] \
                and value.shape[:1] + value.shape[2:] == target.shape[:1] + target.shape[2:]:
            value = value.mean(dim=1, keepdim=True).expand_as(target).clone()
            adapted.append(key)
        if target is not None and target.shape == value.shape:
            loaded[key] = value
        else:
            ignored.append(key)
    model.backbone.load_state_dict(loaded, strict=False)
    report = {"loaded": sorted(loaded),
              "new": sorted(k for k in own if k not in loaded) + ["fc.weight", "fc.bias"],
              "ignored": sorted(ignored), "adapted": adapted,
              "inflated": sorted(k for k in inflated if k in loaded)}
    log.info("pretrained %s: %d tensors loaded, %d new (%s), %d ignored (%s)", path, len(report["loaded"]),
             len(report["new"]), ", ".join(report["new"][:8]), len(ignored), ", ".join(ignored[:8]))
    if report["inflated"]:
        deep = [f"{k.removesuffix('.weight')} x{own[k].shape[2]}" for k in report["inflated"]
                if own[k].shape[2] > 1]
        log.info("pretrained %s: %d 2D kernels loaded as 3D ones, %d inflated over time (each repeated "
                 "over its t frames and divided by t): %s", path, len(report["inflated"]), len(deep),
                 ", ".join(deep))
    if adapted:
        log.info("pretrained %s: cross-modality initialisation of conv1 (TSN): its weights over %d input "
                 "channels averaged, the mean in each of the model's %d", path,
                 state["conv1.weight"].shape[1], own["conv1.weight"].shape[1])
    return report
