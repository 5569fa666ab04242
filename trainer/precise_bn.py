"""Precise BN: batch-norm statistics recomputed at the full shape before validation.

A BN layer's running statistics are an exponential average over the last batches it trained on.
Under multigrid those batches have other shapes than validation's: with the short cycle, two of
every three iterations (to the end of the run) take crops of S/2 and S/√2, whose activations have
other means and variances than the full crop's; after a long-cycle phase the average still remembers
the shorter clips. Wu et al. (2020) therefore recompute the statistics at the full shape before
evaluating ("precise BN", Wu and Johnson 2021), and so does ``--precise-bn N`` here: N training
batches at the full shape (the training transform, ``--batch-size`` clips per rank), forward in
training mode without any update of the weights, and every training BN layer's running mean and
unbiased variance set to those of all its inputs over the N batches of every rank (sums over the
ranks in one allreduce, so the population's, not an average of per-batch ones). Frozen layers
(``--bn partial|frozen``) keep theirs. The global RNG is left as it was, so a resumed run goes on
as an unbroken one would.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from . import metrics
from .data.device_decode import clip_source
from .engine import autocast
from .hooks import Hook


def _layers(model: nn.Module) -> list[nn.BatchNorm2d]:
    return [m for m in model.modules()
            if isinstance(m, nn.BatchNorm2d) and m.training and m.track_running_stats]


@torch.no_grad()
def recompute(model: nn.Module, batches, all_sum=lambda t: t, amp=None) -> None:
    """Set the running statistics of ``model``'s training BN layers to the mean and unbiased
    variance of their inputs over ``batches`` (clip tensors, (B, T, C, H, W)) and over the ranks
    (``all_sum``, one allreduce)."""
    model.train()
    layers = _layers(model)
    device = next(model.parameters()).device
    sums = [torch.zeros(3, m.num_features, dtype=torch.float64, device=device) for m in layers]

    def accumulate(i):
        def hook(module, args):
            x = args[0].detach().double().transpose(0, 1).flatten(1)  # (C, N*H*W)
            sums[i][0] += x.shape[1]
            sums[i][1] += x.sum(1)
            sums[i][2] += x.square().sum(1)
        return hook

    handles = [m.register_forward_pre_hook(accumulate(i)) for i, m in enumerate(layers)]
    tracked = [m.num_batches_tracked.clone() for m in layers]
    try:
        for clips in batches:
            with autocast(device, amp):
                model(clips.to(device, non_blocking=True))
    finally:
        for h in handles:
            h.remove()
    total = all_sum(torch.cat([s.flatten() for s in sums]))
    for i, (m, part) in enumerate(zip(layers, total.split([s.numel() for s in sums]))):
        n, s1, s2 = part.view(3, -1)
        if n[0] < 2:
            raise ValueError("precise BN needs at least two values per channel")
        mean = s1 / n
        var = (s2 - n * mean.square()).clamp(min=0) / (n - 1)
        m.running_mean.copy_(mean)
        m.running_var.copy_(var)
        m.num_batches_tracked.copy_(tracked[i])


def full_shape_batches(t, count: int):
    """The first ``count`` training batches of the current epoch at the full shape (the loader
    the trainer would have without multigrid), real clips only."""
    d = t.cfg.data
    loader = t.new_loader(t.train_loader.manifest, d.train_split, train=True, full_shape=True)
    loader.set_epoch(t.epoch)
    # not t.clips: --clip-log records training steps only
    clips = clip_source(d.decode_on_device, t.engine.device)
    batches = iter(loader)
    try:
        for _, batch in zip(range(count), batches):
            if batch["valid"].any():
                yield clips(batch)[batch["valid"]]
    finally:
        batches.close()  # the workers end here, so their CPU time counts


def update(t, batches: int) -> dict:
    """Precise BN on ``batches`` training batches per rank; its wall-clock
    and CPU seconds (all ranks and their loader workers) for the epoch record."""
    start, cpu = time.perf_counter(), metrics.cpu_seconds()
    devices = [t.engine.device] if t.engine.device.type == "cuda" else []
    # dropout and the loader's seeds leave the run's stream alone
    with torch.random.fork_rng(devices=devices):
        recompute(t.engine.model, full_shape_batches(t, batches), t.backend.all_sum, t.engine.amp)
    spent = t.backend.all_sum(torch.tensor([metrics.cpu_seconds() - cpu], dtype=torch.float64))
    return {"precise_bn_time": time.perf_counter() - start, "precise_bn_cpu": spent.item()}


class PreciseBN(Hook):
    """``--precise-bn N`` as the loop's hook: at every epoch's end, before validation."""

    def __init__(self, batches: int):
        self.batches = batches

    def at_epoch_end(self, t) -> dict:
        return update(t, self.batches)
