"""ResNet backbones (He et al. 2016) with torchvision's parameter names, a hook for TSM, and their
I3D inflation.

Parameter names match torchvision's ``resnet*`` state dicts (``conv1``, ``layer1.0.bn2``,
``layer2.0.downsample.0``, ...), so ImageNet weights saved from torchvision load directly.
Bottlenecks stride in their 3x3 conv (torchvision's "v1.5"). ``width`` scales every
stage (64 is the standard network; 8 gives a tiny one for tests). ``residual_hook`` builds
a parameter-free module that each block applies to the input of its residual branch only:
TSM's "residual shift" leaves the identity path untouched.

Inputs are the frames of clips, (N*T, C, H, W), and every module that needs T (the hook, the
sub-batch BN layers) receives it with the activations: ``forward(x, segments)``. Norm layers are
``SubBatchNorm2d``, an ``nn.BatchNorm2d`` that by default behaves exactly like one.

With an ``inflation`` (``trainer.model.i3d``) the same ResNet is an I3D: the frames are viewed as
clips (N, C, T, H, W) after the input, every convolution is a ``Conv3d`` (t x k x k, with the
temporal kernels the inflation gives its block, 1 elsewhere), the norms ``SubBatchNorm3d``, and time
is max-pooled after the stages it names. The parameter names stay torchvision's (conv weights gain
a time axis), so ``load_pretrained`` inflates ImageNet weights. Only bottleneck ResNets (50, 101,
152) are inflated: the two I3D variants differ by which bottleneck convolution they inflate.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .i3d import Inflation
from .subbatch_bn import SubBatchNorm2d, SubBatchNorm3d

# depth -> (block type, blocks per stage)
DEPTHS = {10: ("basic", (1, 1, 1, 1)), 18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)),
          50: ("bottleneck", (3, 4, 6, 3)), 101: ("bottleneck", (3, 4, 23, 3)),
          152: ("bottleneck", (3, 8, 36, 3))}

Hook = Callable[[], nn.Module]  # modules called as hook(x, segments)


class NoShift(nn.Module):
    """The residual hook of a plain ResNet (and of TSN): the activations as they are."""

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        return x


def conv(cin: int, cout: int, k: int, stride: int = 1, time: int | None = None) -> nn.Module:
    """A k x k convolution zero-padded to keep the size at stride 1: 2D over frames, or with a
    temporal kernel ``time`` a time x k x k one over clips (N, C, T, H, W), time zero-padded by
    time // 2 at both ends and never strided."""
    if time is None:
        return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)
    return nn.Conv3d(cin, cout, (time, k, k), stride=(1, stride, stride), padding=(time // 2, k // 2, k // 2),
                     bias=False)


def norm(channels: int, time: int | None) -> SubBatchNorm2d:
    """The BN layer after ``conv(..., time=time)``."""
    return SubBatchNorm2d(channels) if time is None else SubBatchNorm3d(channels)


class Downsample(nn.Sequential):
    """The projection shortcut: 1x1 conv, then BN (torchvision's ``downsample.0``/``.1`` names);
    ``time`` 1 in an I3D (1x1x1)."""

    def __init__(self, cin: int, cout: int, stride: int, time: int | None = None):
        super().__init__(conv(cin, cout, 1, stride, time), norm(cout, time))

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        return self[1](self[0](x), segments)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, downsample: nn.Module | None, hook: Hook):
        super().__init__()
        self.shift = hook()
        self.conv1 = conv(cin, planes, 3, stride)
        self.bn1 = SubBatchNorm2d(planes)
        self.conv2 = conv(planes, planes, 3)
        self.bn2 = SubBatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x, segments)
        out = self.relu(self.bn1(self.conv1(self.shift(x, segments)), segments))
        out = self.bn2(self.conv2(out), segments)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1, 3x3, 1x1; in an I3D ``times`` are the temporal kernels of the first two (the third is 1x1x1)."""
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, downsample: nn.Module | None, hook: Hook,
                 times: tuple[int, int] | None = None):
        super().__init__()
        t1, t2, t3 = (*times, 1) if times else (None, None, None)
        self.shift = hook()
        self.conv1 = conv(cin, planes, 1, time=t1)
        self.bn1 = norm(planes, t1)
        self.conv2 = conv(planes, planes, 3, stride, t2)
        self.bn2 = norm(planes, t2)
        self.conv3 = conv(planes, planes * 4, 1, time=t3)
        self.bn3 = norm(planes * 4, t3)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x, segments)
        out = self.relu(self.bn1(self.conv1(self.shift(x, segments)), segments))
        out = self.relu(self.bn2(self.conv2(out), segments))
        out = self.bn3(self.conv3(out), segments)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """A ResNet without its classifier: images (B, C, H, W) -> pooled features (B, feature_dim);
    C = ``in_channels`` (3 for RGB; a motion stream's first convolution takes its own). With an
    ``inflation``, an I3D: the frames of clips -> pooled features of each time step left."""

    def __init__(self, depth: int = 50, width: int = 64, residual_hook: Hook = NoShift, in_channels: int = 3,
                 inflation: Inflation | None = None):
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"ResNet depth {depth} not one of {sorted(DEPTHS)}")
        kind, counts = DEPTHS[depth]
        if inflation and kind != "bottleneck":
            raise ValueError(f"an I3D inflates bottleneck convolutions: ResNet depth {depth} has none")
        block = BasicBlock if kind == "basic" else Bottleneck
        self.inflation = inflation
        stem = inflation.stem if inflation else None
        self.conv1 = conv(in_channels, width, 7, 2, stem)
        self.bn1 = norm(width, stem)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)) if inflation else nn.MaxPool2d(3, 2, 1)
        # an I3D's temporal max-pool after the stages its inflation names (2x1x1, stride 2; ceil: odd T
        # keeps its last frame)
        self.time_pool = nn.MaxPool3d((2, 1, 1), (2, 1, 1), ceil_mode=True) if inflation else None
        self.pooled_after = inflation.pool_after if inflation else ()
        cin = width
        for i, n in enumerate(counts):
            planes, stride = width * 2**i, 1 if i == 0 else 2
            blocks = []
            for j in range(n):
                down = None
                if j == 0 and (stride != 1 or cin != planes * block.expansion):
                    down = Downsample(cin, planes * block.expansion, stride, 1 if inflation else None)
                times = {"times": inflation.block(i + 1, j)} if inflation else {}
                blocks.append(block(cin, planes, stride if j == 0 else 1, down, residual_hook, **times))
                cin = planes * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = cin
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Conv3d)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if inflation:  # every residual block starts as the identity, as SlowFast's I3D (ZERO_INIT_FINAL_BN)
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        """Frames (N*T, C, H, W) of clips of ``segments`` frames -> pooled features (N*T', feature_dim)
        of each time step left: T' = T, or an I3D's T after its temporal pools."""
        if self.inflation:
            x = clip_view(x, segments)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x), segments)))
        for i, stage in enumerate((self.layer1, self.layer2, self.layer3, self.layer4), 1):
            for block in stage:
                x = block(x, segments)
            if i in self.pooled_after:
                x = self.time_pool(x)
        if self.inflation:  # (N, C, T', H, W) -> (N*T', C): each time step's spatial mean
            return x.mean((3, 4)).transpose(1, 2).flatten(0, 1)
        return torch.flatten(self.avgpool(x), 1)


def clip_view(frames: torch.Tensor, segments: int) -> torch.Tensor:
    """Frames (N*T, C, H, W) as clips (N, C, T, H, W), channels-last-3d if the frames are channels-last
    (then no copy), else contiguous."""
    x = frames.view(-1, segments, *frames.shape[1:]).transpose(1, 2)
    channels_last = frames.dim() == 4 and frames.is_contiguous(memory_format=torch.channels_last) \
        and not frames.is_contiguous()
    return x.contiguous(memory_format=torch.channels_last_3d if channels_last else torch.contiguous_format)
