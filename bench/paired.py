"""Paired differences between two training modes run at the same seeds, with intervals.

Each pair is one seed trained twice, once per mode (e.g. ``--shuffle global`` and ``--shuffle
node``); everything else (weights, augmentation draws, validation set) is the same, so the
difference of a pair measures the mode, and the pairs' spread how much a seed alone moves it.
``summary`` gives, for differences d_1..d_n (mode B - mode A):

* the mean and a two-sided 95% Student t-interval, mean +- t(0.975, n-1) * sd / sqrt(n) (assumes
  the differences are roughly normal; at n = 2-6 it is wide, which is the point of printing it);
* the signs (B higher, equal, lower) and an exact two-sided sign test over the non-zero ones
  (assumes nothing about the shape; with 4 pairs its smallest p-value is 0.125, so it can only
  say "no evidence" at that size).

Command line: the final validation figures of run directories (their ``metrics.jsonl``), paired
in the order given:

    python bench/paired.py --a /tmp/m/tsm-global-s0 /tmp/m/tsm-global-s1 --b /tmp/m/tsm-node-s0
    /tmp/m/tsm-node-s1
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer import metrics  # noqa: E402

# t(0.975, df) for df = 1..30 (two-sided 95%); above 30 the normal's 1.96 is within 2%
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
        2.042)


def t975(df: int) -> float:
    return T975[df - 1] if df <= len(T975) else 1.96


def sign_test(higher: int, lower: int) -> float:
    """Exact two-sided p-value of ``higher`` against ``lower`` non-zero signs under p = 1/2."""
    n = higher + lower
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(higher, lower) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def summary(diffs: list[float]) -> dict:
    """Mean, sd, 95% t-interval and signs of paired differences (see the module docstring)."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else float("nan")
    half = t975(n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
    higher, lower = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half, "higher": higher,
            "equal": n - higher - lower, "lower": lower, "sign_p": sign_test(higher, lower)}


def describe(s: dict, unit: str = "") -> str:
    """One line: mean [95% t-interval], signs, sign test (3 significant digits: losses are small)."""
    interval = f"[{s['low']:+.3g}, {s['high']:+.3g}]" if s["n"] > 1 else "(one pair)"
    return (f"mean {s['mean']:+.3g}{unit} 95% t-interval {interval} (n={s['n']}, sd {s['sd']:.3g}); "
            f"higher/equal/lower {s['higher']}/{s['equal']}/{s['lower']}, sign test p={s['sign_p']:.2f}")


def final(run: Path) -> dict:
    """A run directory's last-epoch validation top-1 and loss and training loss; its validation top-1
    averaged over the epochs (how early it learnt: the area under its curve, in points); the first
    epoch at its best top-1."""
    epochs = [r for r in metrics.read(str(run / "metrics.jsonl")) if r["event"] == "epoch"]
    best = max(r["val_top1"] for r in epochs)
    return {"top1": epochs[-1]["val_top1"], "loss": epochs[-1]["val_loss"],
            "train_loss": epochs[-1]["train_loss"], "epochs": len(epochs),
            "mean_top1": statistics.fmean(r["val_top1"] for r in epochs),
            "first_at_best": next(r["epoch"] for r in epochs if r["val_top1"] >= best)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", nargs="+", type=Path, required=True,
                   help="runs of mode A (e.g. global), one per seed")
    p.add_argument("--b", nargs="+", type=Path, required=True,
                   help="runs of mode B, the same seeds in the same order")
    p.add_argument("--names", nargs=2, default=("global", "node"), help="the modes' names")
    args = p.parse_args()
    if len(args.a) != len(args.b):
        raise SystemExit(f"paired.py: {len(args.a)} runs of --a against {len(args.b)} of --b: "
                         "pairs need both")
    a, b = [final(r) for r in args.a], [final(r) for r in args.b]
    na, nb = args.names
    figures = "final top-1, val loss, train loss, top-1 over the epochs, first epoch at the best"
    print(f"pair | {na}: {figures} | {nb}: the same | {nb} - {na}: top-1, val loss")
    for ra, rb, fa, fb in zip(args.a, args.b, a, b):
        print(f"{ra.name} / {rb.name} | " + " | ".join(
            f"{f['top1']:.1f}%, {f['loss']:.4f}, {f['train_loss']:.4f}, {f['mean_top1']:.1f}%, "
            f"{f['first_at_best']}"
            for f in (fa, fb)) + f" | {fb['top1'] - fa['top1']:+.1f}, {fb['loss'] - fa['loss']:+.4f}")
    for key, what, unit in (("top1", "final top-1", " points"), ("loss", "final validation loss", ""),
                            ("train_loss", "final training loss", ""),
                            ("mean_top1", "top-1 averaged over the epochs", " points"),
                            ("first_at_best", "first epoch at the best top-1", " epochs")):
        print(f"{nb} - {na}, {what}: {describe(summary([y[key] - x[key] for x, y in zip(a, b)]), unit)}")


if __name__ == "__main__":
    main()
