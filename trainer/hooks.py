"""The one way a feature enters the training loop: a ``Hook`` (after Lightning's callbacks, at a small size).

The loop (``trainer.train``) calls every hook of ``Trainer.hooks``, in order, at seven points, and
knows none of them by name:

* ``before_step(t, batch)``: a training batch is about to be stepped on (``t.step`` its index);
* ``after_step(t, step)``: the optimizer step is done; ``step`` holds what the loop knows of it
  (``clips``, ``lr``, ``seen``, ``loss``, ``data_time``, ``compute_time``) before ``t.step`` moves on;
* ``at_boundary(t)``: where a run may stop and a checkpoint holds one model on every rank (the end
  of a loader batch, every epoch's end), before the ranks agree on a stop signal;
* ``at_epoch_end(t) -> dict``: an epoch's training is over, before validation; what it returns goes
  into the epoch's metrics record;
* ``validation_models(t) -> dict``: further weights to validate beside the model's, by metrics
  prefix (``{"ema": model}`` records ``ema_val_top1``, ...);
* ``validation_batch(t, batch)``: a validation batch is about to be scored (on every rank; ``batch`` None
  where this rank's read failed, which it says in the agreement that follows);
* ``at_validation_end(t) -> dict``: the validation is over; what it returns goes into the epoch's
  metrics record beside the validation's figures.

A hook with state names its ``key``: ``state_dict()`` goes under that key in the checkpoint and in
Horovod Elastic's commits, and ``load_state_dict(state)`` receives it back (None from a checkpoint
written without it): the checkpoint, the resume and the elastic state iterate over the hooks, one
state path. ``close()`` ends what the hook opened.

Which hooks a run has, and which features refuse to combine, is decided in one place:
``trainer.schedules.regime.Regime`` (the regime itself is the first hook: batch growth's decision,
K-step averaging's state) and ``Trainer.__init__``, which adds one hook per feature its config turns on.
"""
from __future__ import annotations

import json
import os

import torch


class Hook:
    """A feature around the training loop; every method is optional (this base does nothing)."""

    key: str | None = None  # the hook's key for its state in checkpoints and elastic commits

    def before_step(self, t, batch: dict) -> None:
        pass

    def after_step(self, t, step: dict) -> None:
        pass

    def at_boundary(self, t) -> None:
        pass

    def at_epoch_end(self, t) -> dict:
        return {}

    def validation_models(self, t) -> dict:
        return {}

    def validation_batch(self, t, batch: dict | None) -> None:
        """After each validation batch, on every rank; ``batch`` None where this rank's read failed."""

    def at_validation_end(self, t) -> dict:
        return {}

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def close(self) -> None:
        pass


class PeriodicCheckpoint(Hook):
    """``--checkpoint-steps N``: a checkpoint at the first boundary of every N steps, besides those
    at epoch ends and stops; bounds what a SIGKILL costs to N steps."""

    def __init__(self, every: int):
        self.every = every

    def at_boundary(self, t) -> None:
        if t.step // self.every > t.saved_step // self.every:
            t.save()


class StepTrace(Hook):
    """``--trace-steps``: one JSON line per optimizer step on every rank, to compare ranks and runs:
    the step's epoch (from 1), batch shape and rate, the weights' sum after it, and the loss, the clips seen
    before it and whether the ranks hold different models (K-step averaging)."""

    def __init__(self, output_dir: str, rank: int):
        os.makedirs(output_dir, exist_ok=True)
        self.file = open(os.path.join(output_dir, f"steps-rank{rank}.jsonl"), "a", encoding="utf-8")

    def after_step(self, t, step: dict) -> None:
        clips, model = step["clips"], t.engine.model
        with torch.no_grad():
            # one device sync
            checksum = torch.stack([p.double().sum() for p in model.parameters()]).sum().item()
        record = {"step": t.step, "epoch": t.epoch + 1, "batch": clips.shape[0], "frames": clips.shape[1],
                  "crop": clips.shape[-1], "lr": step["lr"], "weights": checksum, "seen": step["seen"],
                  "loss": step["loss"], "drifted": t.regime.drifted}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
