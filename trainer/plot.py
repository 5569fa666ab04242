"""Draw loss, accuracy, learning rate and throughput curves of one or more runs to a PNG.

Reads each run's ``metrics.jsonl`` (give the run's output directory or the file), so runs
can be compared on one figure, e.g. TSM against TSN, and prints the same comparison as two
small tables: validation top-1 by epoch, and each run's final figures with its data time
against its compute time per step.
"""
from __future__ import annotations

import os

from shards.base.errors import NotFound, UsageError

from . import metrics


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
        ax_loss.plot(*_series(records, "epoch", "val_loss"), "o--", color=line.get_color(),
                     label=f"{label} val")
        ax_acc.plot(*_series(records, "epoch", "val_top1"), "o-", color=line.get_color(),
                    label=f"{label} top-1")
        ax_acc.plot(*_series(records, "epoch", "val_top5"), "x:", color=line.get_color(),
                    label=f"{label} top-5")
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


def _epochs(run: str) -> list[dict]:
    path = run if run.endswith(".jsonl") else os.path.join(run, "metrics.jsonl")
    return [r for r in metrics.read(path) if r["event"] == "epoch"]


def tables(runs: list[str], labels: list[str], max_rows: int = 8) -> str:
    """Validation top-1 at up to ``max_rows`` evenly spread epochs (the last always), then one row
    per run: final and best top-1, final training loss, data and compute time per step, clips/s."""
    epochs = [_epochs(run) for run in runs]
    width = max(7, *map(len, labels))
    n = max(map(len, epochs))
    rows = min(n, max_rows)
    shown = sorted({round(i * (n - 1) / max(1, rows - 1)) for i in range(rows)})  # first and last among them
    lines = ["validation top-1 (%) by epoch",
             "epoch | " + " | ".join(f"{label:>{width}}" for label in labels)]
    longest = max(epochs, key=len)
    for i in shown:
        cells = [f"{metrics.figure('val_top1', e[i]['val_top1']):>{width}}"
                 if i < len(e) and "val_top1" in e[i] else " " * width for e in epochs]
        lines.append(f"{longest[i]['epoch']:>5} | " + " | ".join(cells))
    lines += ["", f"{'run':<{width}} | final top-1 | best top-1 | train loss | data ms/step | "
              "compute ms/step | clips/s"]
    for label, e in zip(labels, epochs):
        last = e[-1]
        best = max(r.get("val_top1", 0.0) for r in e)
        final, best = (metrics.figure("val_top1", v) for v in (last.get("val_top1", float("nan")), best))
        lines.append(f"{label:<{width}} | {final:>11} | {best:>10} | "
                     f"{last['train_loss']:>10.3f} | {1e3 * last['data_time']:>12.1f} | "
                     f"{1e3 * last['compute_time']:>15.1f} | {last['clips_per_s']:>7.1f}")
    return "\n".join(lines)


def main(runs: list[str], labels: list[str] | None, out: str) -> int:
    """Draw ``runs`` (output directories or their metrics.jsonl) to ``out`` and print the tables;
    ``labels``: one per run (default: the directories' names)."""
    labels = labels or [os.path.basename(os.path.normpath(r.removesuffix("metrics.jsonl"))) for r in runs]
    if len(labels) != len(runs):
        raise UsageError(f"--labels: {len(labels)} labels for {len(runs)} runs; give one label per run")
    for run_ in runs:
        path = run_ if run_.endswith(".jsonl") else os.path.join(run_, "metrics.jsonl")
        if not os.path.exists(path):
            raise NotFound(f"{run_}: no such run" if not os.path.exists(run_) else f"{path}: no metrics (has "
                           "trainer train run into this directory?)")
        if not _epochs(run_):
            raise UsageError(f"{path}: no epoch finished yet, nothing to compare")
    plot(runs, labels, out)
    print(tables(runs, labels))
    print(f"plot: wrote {out}")
    return 0
