"""Weight EMA (``--ema-decay D``): an exponential moving average of the weights, validated and
checkpointed beside them, as timm's ``ModelEmaV2`` and torchvision's reference scripts keep one.

After every optimizer step every parameter and floating-point buffer (BN running statistics) of
the average becomes ``D * average + (1 - D) * current`` (integer buffers, BN's batch counters, are
copied); it starts as the weights the run starts from. Every validation also scores the average,
recorded as ``ema_val_loss``, ``ema_val_top1``, ...; the checkpoint and Horovod Elastic's commits
keep it under ``ema`` (``trainer.hooks``), so a resumed or re-formed run goes on with the same
average. A checkpoint written without it starts the average at the resumed weights (logged).

Refused with K-step averaging (``trainer.schedules.regime``): between synchronisations the ranks'
weights differ, so their averages would too, and a checkpoint keeps rank 0's alone.
"""
from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from .hooks import Hook

log = logging.getLogger(__name__)


class WeightEMA(Hook):
    """The running average of ``model``'s weights with ``decay`` per optimizer step."""

    key = "ema"

    def __init__(self, model: nn.Module, decay: float):
        self.model, self.decay = model, decay
        self.average = copy.deepcopy(model).eval().requires_grad_(False)
        self.updates = 0
        self.started = False  # the average holds the run's starting weights, or a checkpoint's average

    def before_step(self, t, batch: dict) -> None:
        if not self.started:  # the weights every rank starts from (after the resume and the broadcast)
            self.average.load_state_dict(self.model.state_dict())
            self.started = True

    @torch.no_grad()
    def after_step(self, t, step: dict) -> None:
        for mine, theirs in zip(self.average.state_dict().values(), self.model.state_dict().values()):
            if mine.is_floating_point():
                mine.mul_(self.decay).add_(theirs.detach(), alpha=1 - self.decay)
            else:
                mine.copy_(theirs)
        self.updates += 1

    def validation_models(self, t) -> dict:
        return {"ema": self.average}

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates,
                "weights": {k: v.detach().cpu().clone() for k, v in self.average.state_dict().items()}}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:  # resumed from a checkpoint of a run without it: starts at the next step's weights
            log.info("weight EMA: no average in the checkpoint; it starts at the resumed weights")
            return
        self.average.load_state_dict(state["weights"])
        self.updates, self.started = state["updates"], True
