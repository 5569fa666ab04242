"""The temporal shift of TSM (Lin, Gan and Han, ICCV 2019): free temporal mixing for 2D CNNs.

Frames of a clip travel through a 2D network as a batch of N*T images. The shift views the
activations as (N, T, C, H, W) and moves a fraction of the channels one step along T:
the first C/div channels take their value from the next frame, the next C/div from the
previous frame, the rest stay. Values shifted in from beyond the clip's ends are zero.
It has no parameters and no multiply-adds, only memory movement.

T is an argument of every call, not a property of the module: the model passes the T of the
batch it is given, so one network trains on clips of 8, 4 or 2 frames (multigrid) and is
evaluated on 8. Of the shifted channels, a fraction 1/T is zeros (the clip's two ends). At
T=2 that is half: frame 0 takes channels [0, C/div) from frame 1 and has [C/div, 2C/div)
zeroed, frame 1 the reverse, so the two frames still exchange C/div channels each way. At T=1
the shift only zeroes 2C/div channels: there is no other frame to mix with.
"""
from __future__ import annotations

import torch
from torch import nn


def _shifted(x: torch.Tensor, segments: int, fold: int, back: bool) -> torch.Tensor:
    """``x`` (N*T, C, H, W) shifted into a new tensor of the same memory format: channels
    [0, fold) from the next frame and [fold, 2 fold) from the previous, zeros at the ends; with
    ``back`` the two directions swap, which is the shift's gradient (its adjoint).

    A whole-tensor copy, then the shifted quarter written over it: the copy runs at full memory
    bandwidth, where copying the unshifted 3/4 as a channel slice of channels-last memory (runs
    of 3C/4 values) reaches about half of it (H100, bf16)."""
    out = x.clone(memory_format=torch.preserve_format)
    v = x.view(-1, segments, *x.shape[1:])
    o = out.view(v.shape)
    ahead, behind = slice(0, fold), slice(fold, 2 * fold)
    if back:
        ahead, behind = behind, ahead
    o[:, :-1, ahead] = v[:, 1:, ahead]
    o[:, -1, ahead] = 0
    o[:, 1:, behind] = v[:, :-1, behind]
    o[:, 0, behind] = 0
    return out


class _Shift(torch.autograd.Function):
    """Forward and backward are each one copy plus a quarter: built from slices and
    concatenations instead, autograd's backward would allocate and sum a zero-filled
    full-size gradient per slice, which made TSM's step about 30% slower than TSN's on an H100."""

    @staticmethod
    def forward(ctx, x, segments, fold):
        ctx.segments, ctx.fold = segments, fold
        return _shifted(x, segments, fold, back=False)

    @staticmethod
    def backward(ctx, grad):
        return _shifted(grad, ctx.segments, ctx.fold, back=True), None, None


def temporal_shift(x: torch.Tensor, segments: int, shift_div: int = 8) -> torch.Tensor:
    """Shift channels of ``x`` (N*T, C, H, W) along time, T = ``segments``; see the module doc.
    A channels-last input gives a channels-last output."""
    if x.shape[0] % segments:
        raise ValueError(f"batch of {x.shape[0]} frames is not a whole number of {segments}-frame clips")
    return _Shift.apply(x, segments, x.shape[1] // shift_div)


class TemporalShift(nn.Module):
    """:func:`temporal_shift` as a parameter-free module, placed before a block's first conv;
    called with the activations and the T of their clips."""

    def __init__(self, shift_div: int = 8):
        super().__init__()
        self.shift_div = shift_div

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        return temporal_shift(x, segments, self.shift_div)

    def extra_repr(self) -> str:
        return f"shift_div={self.shift_div}"
