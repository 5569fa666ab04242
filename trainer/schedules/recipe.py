"""The large-batch recipe of "Training Kinetics in 15 Minutes" (Lin, Gan and Han, 2019).

SGD with momentum; learning rate linear in the global batch (``lr_per_8`` per 8 clips);
linear warm-up over the first epochs, then cosine decay to zero, set before every step as a
function of the clips seen so far (not of the step count: see :class:`Schedule`); weight decay
on conv and linear weights only, never on BatchNorm parameters or biases.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import OPTIMIZERS

NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


def scaled_lr(lr_per_8: float, global_batch: int) -> float:
    """Linear scaling rule: ``lr_per_8`` for every 8 clips of global batch."""
    return lr_per_8 * global_batch / 8


def warmup_cosine(seen: float, warmup: float, total: float) -> float:
    """Multiplier of the peak learning rate after ``seen`` of ``total`` units of training
    (clips for :class:`Schedule`; any unit works, e.g. steps).

    Linear from 0 at ``seen = 0`` to 1 at ``seen = warmup`` (the first update only fills the
    momentum buffer), then half a cosine from 1 to 0 at ``seen = total``.
    """
    if seen < warmup:
        return seen / warmup
    if total == warmup:
        return 0.0
    progress = min(1.0, (seen - warmup) / (total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups: decayed (conv/linear weights) and not (norm layers, all biases).

    Frozen parameters (``requires_grad=False``, e.g. under partial BN) are left out.
    """
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if isinstance(module, NORM_LAYERS) or name == "bias":
                no_decay.append(p)
            else:
                decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, momentum: float = 0.9, weight_decay: float = 1e-4,
                    nesterov: bool = False, name: str = "sgd", betas: tuple[float, float] = (0.9, 0.999),
                    eps: float = 1e-8) -> torch.optim.Optimizer:
    """SGD (the recipe), Adam (weight decay as an L2 term in the gradient) or AdamW (decoupled
    decay, Loshchilov and Hutter 2019); all three with :func:`param_groups`' no-decay rule."""
    groups = param_groups(model, weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)
    if name in ("adam", "adamw"):
        return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(groups, lr=lr, betas=betas,
                                                                            eps=eps)
    raise ValueError(f"optimizer {name!r} not one of {OPTIMIZERS}")


@dataclass(frozen=True)
class Schedule:
    """The learning rate as a function of clips seen: ``peak`` x :func:`warmup_cosine` over clips.

    Clips seen counts every real clip the run has trained on (global, over all ranks; clips
    repeated only to pad the last batches never count). Unlike a step count it means the same
    whatever the world size, so a run resumed on more or fewer ranks (another global batch,
    another number of steps per epoch) goes on along the same curve against clips seen, and a
    run resumed with more epochs follows its new, longer curve from where it stands. ``peak`` is
    the linear scaling rule's for the run's current global batch.
    """
    peak: float
    warmup_clips: int
    total_clips: int

    def __post_init__(self):
        if not 0 <= self.warmup_clips <= self.total_clips:
            raise ValueError(f"need 0 <= warm-up clips ({self.warmup_clips}) <= total clips "
                             f"({self.total_clips})")

    def lr(self, clips_seen: int) -> float:
        return self.peak * warmup_cosine(clips_seen, self.warmup_clips, self.total_clips)

    def apply(self, optimizer: torch.optim.Optimizer, clips_seen: int, factor: float = 1.0) -> float:
        """Set every parameter group's rate to the one at ``clips_seen`` times ``factor`` (the linear
        scaling rule for a step whose batch is ``factor`` x the base: multigrid, batch growth); returns it."""
        lr = self.lr(clips_seen) * factor
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
