"""Growing the batch during training, and the learning rate that goes with it.

Smith, Kindermans, Ying and Le ("Don't decay the learning rate, increase the batch size", ICLR
2018) read SGD's noise scale as g = ε·N/B (learning rate ε, N training clips, batch B): decaying
ε by k and growing B by k lower the noise alike, and the larger batch needs k times fewer steps.
The rule kept here: whatever the batch, g follows the base schedule's, so

    lr = peak · m(t) · B(t) / B0        (m: the base schedule's multiplier, B0: the base batch)

and growing the batch at a point where the schedule decays leaves the rate where it was. The
global batch B(t) is always B0 times a power of two (ranks keep equal integer batches), capped at
``max_batch``, and grows in one of three ways:

1. ``points``: it doubles at given epochs.
2. ``decay``: it replaces the schedule's decay (Smith et al.): after warm-up, B = B0·2^⌊log2(1/m)⌋,
   so the rate stays within [1/2, 1] of the peak until the cap, where decay takes over again.
3. ``noise``: it doubles when the gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish, Kaplan,
   Amodei et al., "An Empirical Model of Large-Batch Training", 2018) exceeds it: below B_simple a
   larger batch still cuts the steps needed almost in proportion. B_simple is estimated without
   extra passes from the squared gradient norms every data-parallel step already has, the ranks'
   own ones at B_small = B/W and the averaged one at B_big = B (their appendix A.1), each of
   |G|² and tr(Σ) smoothed by an exponential moving average before the ratio is taken. It needs
   two or more ranks (one rank has a single batch size); every rank computes the same value from
   allreduced numbers, so all decide alike.

The loader splits the rest of an epoch anew when the batch changes (``ClipLoader.load_state_dict``
with the new batch size: a new segment of the epoch).
"""
from __future__ import annotations

import math

import torch


def batch_at_points(epoch: float, base: int, points: tuple[float, ...], max_batch: int) -> int:
    """``base`` doubled once per point at or before ``epoch``, capped at ``max_batch``."""
    batch = base
    for _ in (p for p in points if p <= epoch):
        if batch * 2 > max_batch:
            break
        batch *= 2
    return batch


def batch_for_decay(multiplier: float, base: int, max_batch: int) -> int:
    """The batch that replaces the schedule's decay to ``multiplier`` (0 < multiplier <= 1):
    ``base`` doubled for every halving, capped at ``max_batch``."""
    doublings = math.floor(math.log2(1 / multiplier)) if multiplier > 0 else math.inf
    batch = base
    while doublings > 0 and batch * 2 <= max_batch:
        batch, doublings = batch * 2, doublings - 1
    return batch


def lr_multiplier(multiplier: float, batch: int, base: int) -> float:
    """The peak rate's multiplier at ``batch``: the schedule's ``multiplier`` times B/B0 (Smith et al.)."""
    return multiplier * batch / base


def noise_terms(small_sq: float, small_batch: int, big_sq: float, big_batch: int) -> tuple[float, float]:
    """Unbiased estimates of (|G|², tr Σ) from the squared norms of mean gradients over batches of
    ``small_batch`` and ``big_batch`` samples (McCandlish et al. 2018, appendix A.1)."""
    if not 0 < small_batch < big_batch:
        raise ValueError(f"need 0 < small batch ({small_batch}) < big batch ({big_batch})")
    g2 = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
    trace = (small_sq - big_sq) / (1 / small_batch - 1 / big_batch)
    return g2, trace


class NoiseScale:
    """B_simple = tr(Σ)/|G|² from exponential moving averages (``decay``) of both terms, bias-corrected."""

    def __init__(self, decay: float = 0.95):
        self.decay, self.g2, self.trace, self.count = decay, 0.0, 0.0, 0

    def update(self, small_sq: float, small_batch: int, big_sq: float, big_batch: int) -> None:
        g2, trace = noise_terms(small_sq, small_batch, big_sq, big_batch)
        self.g2 = self.decay * self.g2 + (1 - self.decay) * g2
        self.trace = self.decay * self.trace + (1 - self.decay) * trace
        self.count += 1

    @property
    def value(self) -> float:
        """The current estimate (inf until |G|² is positive: no evidence against a larger batch yet)."""
        return self.trace / self.g2 if self.count and self.g2 > 0 else math.inf

    def state_dict(self) -> dict:
        return {"decay": self.decay, "g2": self.g2, "trace": self.trace, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.g2, self.trace, self.count = (state["decay"], state["g2"], state["trace"],
                                                       state["count"])


def batch_for_noise(batch: int, noise_scale: float, max_batch: int) -> int:
    """Double ``batch`` when the noise scale exceeds it and the double fits under ``max_batch``."""
    return batch * 2 if noise_scale > batch and batch * 2 <= max_batch else batch


class LocalGradNorm:
    """The squared norm of this rank's own gradient in the current backward pass.

    Collected by tensor hooks, which run before the gradient is accumulated into ``.grad``, so
    before Horovod's allreduce hooks (registered on the accumulation) and DDP's buckets replace it
    by the average. Under fp16 loss scaling the value is scaled by the loss scale squared."""

    def __init__(self, params):
        self.total = None
        self.handles = [p.register_hook(self._add) for p in params if p.requires_grad]

    def _add(self, grad: torch.Tensor) -> None:
        sq = grad.detach().float().pow(2).sum()
        self.total = sq if self.total is None else self.total + sq

    def pop(self) -> float:
        """The sum since the last pop (0 if no gradient came)."""
        value, self.total = (0.0 if self.total is None else self.total.item()), None
        return value

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def grad_sq_norm(params) -> float:
    """Squared norm of the gradients now in ``.grad`` (after synchronisation: the averaged one)."""
    return sum(p.grad.detach().float().pow(2).sum().item() for p in params if p.grad is not None)
