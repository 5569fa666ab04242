"""Draw loss, accuracy, learning rate and throughput curves of one or more runs to a PNG.

Reads each run's ``metrics.jsonl`` (give the run's output directory or the file), so runs
can be compared on one figure, e.g. TSM against TSN.
"""
from __future__ import annotations

import argparse
import os

from . import metrics


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="output directories of trainer train (or their metrics.jsonl)")
    p.add_argument("--labels", nargs="+", help="legend labels, one per run (default: directory names)")
    p.add_argument("--out", default="curves.png", help="PNG to write")


def _series(records: list[dict], event: str, key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in records if r["event"] == event and key in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot(runs: list[str], labels: list[str], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (ax_loss, ax_acc), (ax_lr, ax_speed) = axes
    for run, label in zip(runs, labels):
        path = run if run.endswith(".jsonl") else os.path.join(run, "metrics.jsonl")
        records = metrics.read(path)
        line, = ax_loss.plot(*_series(records, "train", "loss"), label=f"{label} train", alpha=0.8)
        ax_loss.plot(*_series(records, "epoch", "val_loss"), "o--", color=line.get_color(), label=f"{label} val")
        ax_acc.plot(*_series(records, "epoch", "val_top1"), "o-", color=line.get_color(), label=f"{label} top-1")
        ax_acc.plot(*_series(records, "epoch", "val_top5"), "x:", color=line.get_color(), label=f"{label} top-5")
        ax_lr.plot(*_series(records, "train", "lr"), color=line.get_color(), label=label)
        ax_speed.plot(*_series(records, "train", "clips_per_s"), color=line.get_color(), label=label)
    for ax, title, ylabel in ((ax_loss, "loss", "cross-entropy"), (ax_acc, "validation accuracy", "%"),
                              (ax_lr, "learning rate", "lr"), (ax_speed, "training throughput", "clips/s")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    labels = args.labels or [os.path.basename(os.path.normpath(r.removesuffix("metrics.jsonl"))) for r in args.runs]
    if len(labels) != len(args.runs):
        raise SystemExit("give one label per run")
    plot(args.runs, labels, args.out)
    print(f"plot: wrote {args.out}")
    return 0
