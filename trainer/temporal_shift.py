"""The temporal shift of TSM (Lin, Gan and Han, ICCV 2019): free temporal mixing for 2D CNNs.

Frames of a clip travel through a 2D network as a batch of N*T images. The shift views the
activations as (N, T, C, H, W) and moves a fraction of the channels one step along T:
the first C/div channels take their value from the next frame, the next C/div from the
previous frame, the rest stay. Values shifted in from beyond the clip's ends are zero.
It has no parameters and no multiply-adds, only memory movement.
"""
from __future__ import annotations

import torch
from torch import nn


def temporal_shift(x: torch.Tensor, segments: int, shift_div: int = 8) -> torch.Tensor:
    """Shift channels of ``x`` (N*T, C, H, W) along time, T = ``segments``; see the module doc.

    Built from slices and concatenations (no in-place writes), which autograd turns into a
    cheap backward; a channels-last input gives a channels-last output.
    """
    nt, c, h, w = x.shape
    if nt % segments:
        raise ValueError(f"batch of {nt} frames is not a whole number of {segments}-frame clips")
    fold = c // shift_div
    nhwc = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    v = x.permute(0, 2, 3, 1) if nhwc else x  # dense (NT, H, W, C) or (NT, C, H, W)
    v = v.view(nt // segments, segments, *v.shape[1:])
    cdim = 4 if nhwc else 2
    from_next = v.narrow(cdim, 0, fold).narrow(1, 1, segments - 1)
    from_prev = v.narrow(cdim, fold, fold).narrow(1, 0, segments - 1)
    edge = from_next.new_zeros(from_next.shape[:1] + (1,) + from_next.shape[2:])
    out = torch.cat([torch.cat([from_next, edge], 1), torch.cat([edge, from_prev], 1),
                     v.narrow(cdim, 2 * fold, c - 2 * fold)], cdim)
    out = out.view(nt, *v.shape[2:])
    return out.permute(0, 3, 1, 2) if nhwc else out


class TemporalShift(nn.Module):
    """:func:`temporal_shift` as a parameter-free module, placed before a block's first conv."""

    def __init__(self, segments: int, shift_div: int = 8):
        super().__init__()
        self.segments = segments
        self.shift_div = shift_div

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return temporal_shift(x, self.segments, self.shift_div)

    def extra_repr(self) -> str:
        return f"segments={self.segments}, shift_div={self.shift_div}"
