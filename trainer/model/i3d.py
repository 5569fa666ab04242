"""I3D: the 3D ResNet baselines TSM is compared with, and the inflation of 2D weights into them.

Carreira and Zisserman (2017, "Quo Vadis, Action Recognition?") *inflate* an image network into a
video network: each k x k kernel becomes t x k x k, initialised from the ImageNet kernel repeated t
times over time and divided by t. On a clip whose frames are all equal, every inflated convolution
then computes what the 2D one computes on that frame, wherever its t taps all fall inside the clip.
Wang et al. (2018, "Non-local Neural Networks", section 4.1) inflate ResNet-50 in two ways, named by
the kernel they inflate: **I3D 3x3x3** (a bottleneck's 3x3 convolution becomes 3x3x3) and
**I3D 3x1x1** (its first 1x1 becomes 3x1x1); only one kernel of every two residual blocks is
inflated, and conv1 becomes 5x7x7.

Which blocks carry a temporal kernel and where time is pooled follow SlowFast's I3D configuration
(``MODEL.ARCH: i3d`` of Feichtenhofer et al.'s SlowFast code base, the Non-local paper's ResNet-50
I3D for 8-frame clips; facts taken from its configuration, not its code):

* conv1 5x7x7 (no temporal stride), then the stem's max-pool 1x3x3 with spatial stride 2;
* temporal kernel sizes per stage, cycled over the stage's blocks: res2 (3), res3 (3, 1),
  res4 (3, 1), res5 (1, 3), i.e. all 3 blocks of res2, blocks 0 and 2 of res3, 0, 2 and 4 of res4,
  block 1 of res5; SlowFast puts them on the bottleneck's first convolution (3x1x1), the 3x3x3
  variant puts the same kernels on the 3x3 convolution instead (blocks and pooling unchanged);
* one temporal max-pool 2x1x1, stride 2, after res2: T frames in conv1 and res2, T/2 in res3-res5;
* no temporal stride in any convolution, and time zero-padded by t // 2 at both ends;
* each bottleneck's last BN scale starts at zero (``ZERO_INIT_FINAL_BN``): a block starts as the
  identity, which lets the 50-layer 3D network train from scratch (ImageNet inflation overwrites it).

So for 8-frame clips both variants run conv1 and res2 at 8 time steps and res3-res5 at 4; the
variants differ in cost only by the kernel they inflate (``bench/models.py`` also measures SlowFast's
``i3d_nopool``, the same kernels without the temporal pool: every stage at T). One departure: the
temporal pool rounds up (``ceil_mode``), so a clip of odd T keeps its last frame and a 1-frame clip
still passes (equal to SlowFast's for even T).

Where a clip's ends are zero-padded the inflated network is not the 2D one any more: an end frame
sees zeros where a neighbour would be. Hence "a constant clip gives the image network's output"
holds exactly for the time steps whose receptive field lies inside the clip
(``tests/test_i3d.py``), not for the clip's average.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Inflation:
    """Where an I3D ResNet has temporal kernels, and after which stages it halves time."""
    # the bottleneck convolution that takes the temporal kernel: "conv1" (3x1x1) or "conv2" (3x3x3)
    inflated: str
    stem: int = 5  # conv1's temporal kernel
    kernels: tuple[tuple[int, ...], ...] = ((3,), (3, 1), (3, 1), (1, 3))  # per stage, cycled over its blocks
    pool_after: tuple[int, ...] = (1,)  # stages (1: res2) followed by a 2x1x1 max-pool of stride 2

    def block(self, stage: int, index: int) -> tuple[int, int]:
        """Temporal kernels of the first two convolutions of block ``index`` of ``stage`` (1: res2)."""
        cycle = self.kernels[stage - 1]
        t = cycle[index % len(cycle)]
        return (t, 1) if self.inflated == "conv1" else (1, t)


# the networks of ``--arch i3d-*`` (trainer.config.ARCHS)
INFLATIONS = {"i3d-3x3x3": Inflation("conv2"), "i3d-3x1x1": Inflation("conv1")}


def inflate(weight: torch.Tensor, time: int) -> torch.Tensor:
    """A 2D kernel (out, in, kh, kw) as a t x kh x kw one: repeated over time, divided by ``time``."""
    return weight.unsqueeze(2).repeat(1, 1, time, 1, 1) / time
