"""ResNet backbones (He et al. 2016) with torchvision's parameter names, and a hook for TSM.

Parameter names match torchvision's ``resnet*`` state dicts (``conv1``, ``layer1.0.bn2``,
``layer2.0.downsample.0``, ...), so ImageNet weights saved from torchvision load directly.
Bottlenecks stride in their 3x3 conv (torchvision's "v1.5"). ``width`` scales every
stage (64 is the standard network; 8 gives a tiny one for tests). ``residual_hook`` builds
a parameter-free module that each block applies to the input of its residual branch only:
TSM's "residual shift" leaves the identity path untouched.

Inputs are the frames of clips, (N*T, C, H, W), and every module that needs T (the hook, the
sub-batch BN layers) receives it with the activations: ``forward(x, segments)``. Norm layers are
``SubBatchNorm2d``, an ``nn.BatchNorm2d`` that by default behaves exactly like one.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .subbatch_bn import SubBatchNorm2d

# depth -> (block type, blocks per stage)
DEPTHS = {10: ("basic", (1, 1, 1, 1)), 18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)),
          50: ("bottleneck", (3, 4, 6, 3)), 101: ("bottleneck", (3, 4, 23, 3)),
          152: ("bottleneck", (3, 8, 36, 3))}

Hook = Callable[[], nn.Module]  # modules called as hook(x, segments)


class NoShift(nn.Module):
    """The residual hook of a plain ResNet (and of TSN): the activations as they are."""

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        return x


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class Downsample(nn.Sequential):
    """The projection shortcut: 1x1 conv, then BN (torchvision's ``downsample.0``/``.1`` names)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__(conv1x1(cin, cout, stride), SubBatchNorm2d(cout))

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        return self[1](self[0](x), segments)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, downsample: nn.Module | None, hook: Hook):
        super().__init__()
        self.shift = hook()
        self.conv1 = conv3x3(cin, planes, stride)
        self.bn1 = SubBatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = SubBatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x, segments)
        out = self.relu(self.bn1(self.conv1(self.shift(x, segments)), segments))
        out = self.bn2(self.conv2(out), segments)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, downsample: nn.Module | None, hook: Hook):
        super().__init__()
        self.shift = hook()
        self.conv1 = conv1x1(cin, planes)
        self.bn1 = SubBatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = SubBatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * 4)
        self.bn3 = SubBatchNorm2d(planes * 4)
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
    C = ``in_channels`` (3 for RGB; a motion stream's first convolution takes its own)."""

    def __init__(self, depth: int = 50, width: int = 64, residual_hook: Hook = NoShift, in_channels: int = 3):
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"ResNet depth {depth} not one of {sorted(DEPTHS)}")
        kind, counts = DEPTHS[depth]
        block = BasicBlock if kind == "basic" else Bottleneck
        self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = SubBatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = width
        for i, n in enumerate(counts):
            planes, stride = width * 2**i, 1 if i == 0 else 2
            blocks = []
            for j in range(n):
                down = None
                if j == 0 and (stride != 1 or cin != planes * block.expansion):
                    down = Downsample(cin, planes * block.expansion, stride)
                blocks.append(block(cin, planes, stride if j == 0 else 1, down, residual_hook))
                cin = planes * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = cin
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        """Frames (N*T, C, H, W) of clips of ``segments`` frames -> pooled features (N*T, feature_dim)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x), segments)))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in stage:
                x = block(x, segments)
        return torch.flatten(self.avgpool(x), 1)
