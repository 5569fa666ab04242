"""Metrics: training-step sums, top-k counts, and a rank-0 log to JSONL and TensorBoard.

Every record is one JSON line ``{"event": ..., "step": ..., <name>: <number>, ...}`` in
``<output>/metrics.jsonl``; ``trainer plot`` reads it back. A resumed run continues the file,
which then reads as one run's. The same numbers go to TensorBoard under ``<event>/<name>`` when
it is enabled. PyTorch is imported only where a tensor is made, so ``trainer plot``, which reads
the file back, runs without loading it.
"""
from __future__ import annotations

import json
import os
import resource
from typing import TYPE_CHECKING

from shards.io import storage

if TYPE_CHECKING:
    import torch


class StepTotals:
    """Sums over training steps that add up over ranks and across a resume: the loss summed over
    real clips (padding repeats never count), the real clips, data and compute seconds, steps
    summed over ranks, and wall-clock seconds (rank 0 adds them, the others 0: one clock)."""

    FIELDS = ("loss", "clips", "data_time", "compute_time", "rank_steps", "wall_time")

    def __init__(self, values: dict | None = None):
        self.values = dict.fromkeys(self.FIELDS, 0.0) | (values or {})

    def add(self, loss: float, clips: int, data_time: float, compute_time: float, wall_time: float) -> None:
        for name, value in zip(self.FIELDS, (loss, clips, data_time, compute_time, 1, wall_time)):
            self.values[name] += value

    def reduce(self, all_sum) -> "StepTotals":
        """The sums over every rank; ``all_sum`` is the backend's (every rank must call this)."""
        import torch

        total = all_sum(torch.tensor([self.values[k] for k in self.FIELDS], dtype=torch.float64))
        return StepTotals(dict(zip(self.FIELDS, total.tolist())))

    def summary(self) -> dict:
        v = self.values
        steps, clips = max(v["rank_steps"], 1), max(v["clips"], 1)
        return {"loss": v["loss"] / clips, "data_time": v["data_time"] / steps,
                "compute_time": v["compute_time"] / steps,
                "clips_per_s": v["clips"] / max(v["wall_time"], 1e-9), "time": v["wall_time"]}


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (a rank's loader workers,
    which end with each epoch's iteration): the work done, whatever else shares the machine."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def is_percent(name: str) -> bool:
    """Whether a metric is a percentage (top-1, top-5 of any weights: ``val_top1``, ``ema_val_top5``)."""
    return name.endswith(("top1", "top5"))


def figure(name: str, value: float) -> str:
    """A metric as every line and table shows it: percentages to one decimal (``68.8``), the rest to
    four significant digits. One rounding everywhere: the epoch's log line, ``trainer plot``'s
    tables and the demo's live line (``scripts/demo.sh``, awk's ``%.1f``, the same correctly rounded
    binary value) show the same digits for the same record."""
    return f"{value:.1f}" if is_percent(name) else f"{value:.4g}"


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...], mask: torch.Tensor) -> list:
    """For each k, how many rows (where ``mask``) have their label among the top-k scores."""
    k_max = min(max(ks), logits.shape[1])
    top = logits.topk(k_max, dim=1).indices
    hit = (top == labels[:, None]) & mask[:, None]
    return [hit[:, :min(k, k_max)].any(dim=1).sum() for k in ks]


class MetricsLog:
    """Append-only metrics of one run; a no-op object on ranks other than 0."""

    def __init__(self, output_dir: str | None, enabled: bool = True, tensorboard: bool = True,
                 after_step: int | None = None):
        """``after_step``: a resumed run's step; records of later steps (logged by a run killed
        after its checkpoint, and about to be trained again) are dropped from the file first."""
        self.file = self.tb = None
        if not enabled or not output_dir:
            return
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "metrics.jsonl")
        if after_step is not None and os.path.exists(path):
            kept = [r for r in read(path) if r["step"] <= after_step]
            storage.atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self.file = open(path, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                    purge_step=None if after_step is None else after_step + 1)

    def log(self, event: str, step: int, **values) -> None:
        if self.file is None:
            return
        record = {"event": event, "step": step, **{k: _number(v) for k, v in values.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for name, value in record.items():
                if name not in ("event", "step", "epoch") and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{event}/{name}", value, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def read(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _number(v):
    """A tensor's (or NumPy scalar's) value as a Python number; other values as they are."""
    return v.item() if hasattr(v, "item") else v
