"""An equivalence test (TOST) on paired differences: the pairs it needs, the power it has, its verdict.

For paired differences d_1..d_n (mode B - mode A, e.g. node-affine - global final top-1) and a margin m
(the largest difference that would not matter), the two one-sided t-tests at level alpha show
equivalence when the 1 - 2 alpha Student t-interval of the mean lies inside [-m, +m]. Printed:

* the pairs needed for a stated power at a true difference of 0, from a stated sd: the normal
  approximation n = (z(1 - alpha) + z(1 - beta/2))^2 sd^2 / m^2, and the smallest n whose exact power
  (simulated: the mean normal, the sd from its chi-square) reaches it; and the smallest n at which a
  1 - 2 alpha interval can fit inside +-m at all (its half-width below m at that sd);
* with ``--diffs`` or ``--paired-log`` (``bench/paired.py``'s output, its last column's first figure):
  the interval, the verdict, and the power that pair count had, at the pairs' own sd and at ``--sd``.

No I/O beyond reading the log; numpy only (the t quantiles by integrating the density).

    python bench/equivalence.py --margin 2 --sd 12.3 --paired-log bench/results/paired-affine-pooled-cpu2.log
"""
from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import numpy as np

SIMULATIONS = 200_000


def t_cdf(x: float, df: int) -> float:
    """Student t's distribution function, by Simpson's rule over its density from 0 to ``x``."""
    grid = np.linspace(0.0, abs(x), 20_001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(log_c - (df + 1) / 2 * np.log1p(grid ** 2 / df))
    h = grid[1] - grid[0]
    area = h / 3 * (pdf[0] + pdf[-1] + 4 * pdf[1:-1:2].sum() + 2 * pdf[2:-1:2].sum())
    return 0.5 + math.copysign(area, x)


def t_quantile(p: float, df: int) -> float:
    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def z_quantile(p: float) -> float:
    return statistics.NormalDist().inv_cdf(p)


def power(n: int, sd: float, margin: float, alpha: float, true: float = 0.0, seed: int = 0) -> float:
    """Probability that TOST shows equivalence with ``n`` pairs of spread ``sd`` at a true mean ``true``."""
    rng = np.random.default_rng([seed, n])
    mean = rng.normal(true, sd / math.sqrt(n), SIMULATIONS)
    s = sd * np.sqrt(rng.chisquare(n - 1, SIMULATIONS) / (n - 1))
    half = t_quantile(1 - alpha, n - 1) * s / math.sqrt(n)
    return float(np.mean((mean - half > -margin) & (mean + half < margin)))


def pairs_needed(sd: float, margin: float, alpha: float, target: float) -> tuple[int, int]:
    """(normal approximation, smallest n of simulated power >= ``target``)."""
    approx = math.ceil((z_quantile(1 - alpha) + z_quantile(1 - (1 - target) / 2)) ** 2 * sd ** 2
                       / margin ** 2)
    lo, hi = 2, 4 * approx + 10
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if power(mid, sd, margin, alpha) < target else (lo, mid)
    return approx, lo


def fits(sd: float, margin: float, alpha: float) -> int:
    """The smallest n whose interval at spread ``sd`` is narrower than the margin on each side."""
    n = 2
    while t_quantile(1 - alpha, n - 1) * sd / math.sqrt(n) >= margin:
        n += 1
    return n


def diffs_of(log: Path) -> list[float]:
    """The first figure of each pair line's last column in ``bench/paired.py``'s output."""
    out = []
    for line in log.read_text().splitlines():
        if " / " in line.split("|")[0] and line.count("|") >= 3:
            out.append(float(line.split("|")[-1].split(",")[0]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--margin", type=float, default=2.0)
    p.add_argument("--sd", type=float, required=True, help="the paired differences' spread to plan with")
    p.add_argument("--alpha", type=float, default=0.05, help="each one-sided test's level")
    p.add_argument("--powers", type=float, nargs="+", default=[0.8, 0.9])
    p.add_argument("--diffs", type=float, nargs="*", default=[])
    p.add_argument("--paired-log", type=Path, help="bench/paired.py's output: the pairs' differences")
    args = p.parse_args()
    m, a = args.margin, args.alpha
    print(f"TOST at +-{m:g}, each one-sided test at {a:g} ({100 * (1 - 2 * a):.0f}% interval), planned sd "
          f"{args.sd:g}")
    for target in args.powers:
        approx, exact = pairs_needed(args.sd, m, a, target)
        print(f"pairs for power {target:g} at a true difference of 0: {exact} "
              f"(normal approximation {approx})")
    print(f"pairs before an interval can fit inside +-{m:g} at all: {fits(args.sd, m, a)}")
    diffs = args.diffs + (diffs_of(args.paired_log) if args.paired_log else [])
    if len(diffs) < 2:
        return
    n, mean, sd = len(diffs), statistics.mean(diffs), statistics.stdev(diffs)
    half = t_quantile(1 - a, n - 1) * sd / math.sqrt(n)
    shown = -m < mean - half and mean + half < m
    print(f"{n} pairs: mean {mean:+.2f}, sd {sd:.2f}, {100 * (1 - 2 * a):.0f}% interval [{mean - half:+.2f}, "
          f"{mean + half:+.2f}]: equivalence {'shown' if shown else 'not shown'}")
    print(f"power those {n} pairs had (true difference 0): {power(n, sd, m, a):.4f} at their sd, "
          f"{power(n, args.sd, m, a):.4f} at sd {args.sd:g}")


if __name__ == "__main__":
    main()
