"""The large-batch recipe of "Training Kinetics in 15 Minutes" (Lin, Gan and Han, 2019).

SGD with momentum; learning rate linear in the global batch (``lr_per_8`` per 8 clips);
linear warm-up over the first epochs, then cosine decay to zero, updated every step;
weight decay on conv and linear weights only, never on BatchNorm parameters or biases.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


def scaled_lr(lr_per_8: float, global_batch: int) -> float:
    """Linear scaling rule: ``lr_per_8`` for every 8 clips of global batch."""
    return lr_per_8 * global_batch / 8


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Steps ``0 .. warmup-1`` ramp linearly, ``(step + 1) / warmup``, so the first update
    already moves and step ``warmup - 1`` runs at the peak. From ``warmup`` on the
    multiplier follows half a cosine from 1 at ``step = warmup`` to 0 at ``step = total``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps == warmup_steps:
        return 0.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
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


OPTIMIZERS = ("sgd", "adam", "adamw")


def build_optimizer(model: nn.Module, lr: float, momentum: float = 0.9, weight_decay: float = 1e-4,
                    nesterov: bool = False, name: str = "sgd", betas: tuple[float, float] = (0.9, 0.999),
                    eps: float = 1e-8) -> torch.optim.Optimizer:
    """SGD (the recipe), Adam (weight decay as an L2 term in the gradient) or AdamW (decoupled
    decay, Loshchilov and Hutter 2019); all three with :func:`param_groups`' no-decay rule."""
    groups = param_groups(model, weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)
    if name in ("adam", "adamw"):
        return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(groups, lr=lr, betas=betas, eps=eps)
    raise ValueError(f"optimizer {name!r} not one of {OPTIMIZERS}")


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    """Per-step LambdaLR over :func:`warmup_cosine`; call ``step()`` after every optimizer step.

    The schedule itself is not part of its state: see :func:`load_scheduler_state`.
    """
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need 0 <= warm-up steps ({warmup_steps}) <= total steps ({total_steps})")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(warmup_cosine, warmup_steps=warmup_steps, total_steps=total_steps))


def load_scheduler_state(scheduler, state: dict) -> None:
    """Restore the step count, and set the learning rate from this run's schedule at that step
    (a run resumed with more epochs follows its new, longer schedule from the first step on)."""
    scheduler.load_state_dict(state)
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
