"""Start-up cost of the command lines' help, side by side for two checkouts (e.g. a branch against main).

For each command, runs ``python -X importtime -c <command --help>`` with each checkout first on
PYTHONPATH, interleaved, and prints the median CPU seconds of the process (user + system: less
sensitive than wall time to other jobs on a shared machine), the top-level import time and the
number of modules imported, then the ratio of the CPU medians.

    python bench/startup.py --base /path/to/main-checkout [--runs 7]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

COMMANDS = {"trainer train --help": "import sys; from trainer.cli import main; sys.exit(main(['train', "
                                    "'--help']))",
            "shards verify --help": "import sys; from shards.cli import main; sys.exit(main(['verify', "
                                    "'--help']))"}


def measure(tree: str, code: str) -> tuple[float, float, int]:
    """(CPU seconds, top-level import seconds, modules imported) of one run under ``tree``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=tree, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": tree}, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in run.stderr.splitlines() if line.startswith("import time:") and "|" in line][1:]
    top = sum(int(line.split("|")[1]) for line in lines if not line.split("|")[2].startswith("  "))
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, top / 1e6, len(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the other checkout")
    p.add_argument("--head", default=str(Path(__file__).resolve().parent.parent),
                   help="default: this checkout")
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    trees = {"base": args.base, "head": args.head}
    for name, code in COMMANDS.items():
        results = {label: [] for label in trees}
        for _ in range(args.runs):
            for label, tree in trees.items():
                results[label].append(measure(tree, code))
        cpu = {}
        for label, runs in results.items():
            cpu[label] = statistics.median(r[0] for r in runs)
            print(f"{name:22s} {label}: CPU {1e3 * cpu[label]:6.0f} ms, imports "
                  f"{1e3 * statistics.median(r[1] for r in runs):6.0f} ms, {runs[-1][2]} modules (median of "
                  f"{args.runs}, interleaved)")
        print(f"{name:22s} head/base CPU: {cpu['head'] / cpu['base']:.2f}")


if __name__ == "__main__":
    main()
