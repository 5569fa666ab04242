"""Faster to the same accuracy? The fixed-shape baseline against multigrid, batch growth and K-step averaging.

On ``ingest synth`` motion data (four classes that differ only in the direction a textured disc
moves; ``--speed-scale 0.5`` by default, so that a 2-frame clip's disc moves at most a radius per
step instead of up to half the frame), every variant trains the same tiny TSM on two Horovod ranks (gloo, CPU)
through ``trainer train``, validating after every epoch:

* ``baseline``: the fixed shape (8 frames, 32 px, 2 clips per rank), synchronous;
* ``multigrid``: ``--multigrid both`` (long and short cycles), synchronous;
* ``multigrid-long``: the long cycle alone;
* ``growth``: ``--batch-growth noise``, up to 16 clips per rank, synchronous;
* ``kstep``: ``--average-every 4``: each rank steps alone, the ranks average every 4 steps.

Multigrid gets one stage boundary (``--multigrid-stages`` at 2/3 of the epochs), so its long cycle
runs once: with the cosine rate, a restart at 8x the rate on 2-frame clips undoes much of what
was learnt (BENCHMARKS.md). Its variants recompute BN statistics at the full shape before every
validation (``--precise-bn``); that time counts as training.

The target is the baseline's final validation accuracy. For each run: training wall-clock (the
sum of the epochs' training time, validation left out), training CPU seconds (both ranks and
their loader workers: the work done, much less sensitive than wall-clock to what else runs on a
shared machine), optimizer steps, model synchronisations (allreduce rounds of gradients or models;
metric allreduces left out) and clips seen when the target is first reached, and the final accuracy. Variants
run one after another, repeated ``--repeats`` times in turn, so a neighbour's load hits them alike; the table
gives each variant's median and its ratios to the baseline of the same repeat. One plot shows validation
accuracy against training wall-clock for every run.

Node-affine epochs (issues 18, 27): ``--nodes 2 --shuffles global node`` spreads the ranks over
two simulated nodes (``horovodrun -H localhost:R,127.0.0.1:R``, names horovodrun starts locally;
``--nodes 4`` adds the machine's other names for loopback, ``local_names``) and trains every variant
once with global epochs and once node-affine (``--shuffle node``: each node reads only its share
of the 16 training shards, the whole run), with the same seed; the target is then the global
baseline's, and a last table gives each variant's paired differences, node - global at the same
seed, of the final top-1 and losses with a 95% t-interval and the signs (``bench/paired.py``).
``--seed-per-repeat`` gives repeat r ``--seed r`` (CPU training is deterministic: without it
repeats differ only in timings). ``--from-runs`` prints the tables of the finished runs in WORK,
training nothing (a bench stopped partway); ``--keep`` trains only the runs not finished yet.

    python bench/schedules.py                          # data in /tmp/kinetics-fast-schedules
    python bench/schedules.py --repeats 3 --variants baseline multigrid --png schedules.png
    python bench/schedules.py --nodes 2 --shuffles global node --variants baseline kstep growth
    python bench/schedules.py --nodes 4 --ranks 4 --shuffles global node --variants baseline --repeats 2 \
        --seed-per-repeat --keep
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import time
from pathlib import Path

import paired
from synthsets import finished, start_training, synth_shards, training_command

from trainer import metrics

# the model and data: a ResNet-10 of width 16, 8-frame clips, 32 px crops, 2 clips per rank; the
# rate is low enough for multigrid's 8x (on this task 4x the baseline's rate already learns slower)
COMMON = ["--segments", "8", "--depth", "10", "--width", "16", "--crop-size", "32", "--scale-size", "32",
          "--no-flip", "--batch-size", "2", "--warmup-epochs", "2", "--lr-per-8", "0.0125", "--workers", "1",
          "--print-freq", "64", "--no-tensorboard"]


def variants(epochs: int, precise_bn: int) -> dict[str, list[str]]:
    stages = ["--multigrid-stages", str(round(epochs * 2 / 3)), "--precise-bn", str(precise_bn)]
    return {"baseline": [], "multigrid": ["--multigrid", "both", *stages],
            "multigrid-long": ["--multigrid", "long", *stages],
            "growth": ["--batch-growth", "noise", "--max-batch-size", "16"],
            "kstep": ["--average-every", "4"]}


VARIANTS = list(variants(12, 0))


def make_data(work: Path, train_per_class: int, val_per_class: int, speed_scale: float) -> Path:
    """Motion videos (64x64, 2 s at 10 fps, speeds times ``speed_scale``) ingested into 8-frame
    clips, four per training video."""
    return synth_shards(work / "videos", work / "shards",
                        ["--classes", "4", "--train-per-class", str(train_per_class),
                         "--val-per-class", str(val_per_class), "--width", "64", "--height", "64",
                         "--fps", "10", "--seconds", "2", "--workers", "2",
                         "--speed-scale", str(speed_scale)],
                        ["--frames", "8", "--clips-per-video", "4", "--short-side", "48",
                         "--shard-samples", "64", "--workers", "2"])


def local_names() -> list[str]:
    """Names of this machine that horovodrun starts locally, each a simulated node to the trainer
    (it takes a rank's ``-H`` name as its host): ``localhost``, ``127.0.0.1``, then the machine's
    host name and the other names /etc/hosts gives a loopback address, in that order; every one
    resolves to a loopback address, so ranks talk over loopback whatever name they run under."""
    names = ["localhost", "127.0.0.1", socket.gethostname()]
    with contextlib.suppress(OSError), open("/etc/hosts", encoding="utf-8") as f:
        names += [n for line in f if line.split("#")[0].startswith("127.")
                  for n in line.split("#")[0].split()[1:]]
    out = []
    for name in names:
        with contextlib.suppress(OSError):
            if name not in out and socket.gethostbyname(name).startswith("127."):
                out.append(name)
    return out


def hosts(ranks: int, nodes: int) -> str:
    """horovodrun's ``-H`` for ``nodes`` simulated nodes of this machine, ``ranks // nodes`` each:
    as many as ``local_names`` finds (2 anywhere, 4 on a machine whose /etc/hosts names
    127.0.0.1 twice more)."""
    names = local_names()
    if not 1 <= nodes <= len(names) or ranks % nodes:
        raise SystemExit(f"--nodes {nodes}: 1 to {len(names)} simulated nodes (this machine's names for "
                         f"loopback: {', '.join(names)}), each with the same number of the --ranks {ranks}")
    return ",".join(f"{h}:{ranks // nodes}" for h in names[:nodes])


def run_flags(epochs: int, extra: list[str], shuffle: str) -> list[str]:
    return ["--epochs", str(epochs), "--shuffle", shuffle, *COMMON, *extra]


def train(data: Path, out: Path, flags: list[str], ranks: int, nodes: int) -> float:
    """One ``trainer train`` run on ``ranks`` Horovod ranks on ``nodes`` simulated nodes; returns its
    wall-clock seconds."""
    start = time.perf_counter()
    proc = start_training(data, out, flags, ranks, hosts(ranks, nodes))
    if proc.wait():
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return time.perf_counter() - start


def curve(out: Path) -> list[dict]:
    """Per epoch, cumulative: training wall-clock and CPU seconds (all ranks and their loader
    workers), steps, synchronisations, the values each rank put into them (millions), clips seen;
    and the validation top-1 and loss, and the training loss."""
    seconds = cpu = 0.0
    rows = []
    for r in metrics.read(str(out / "metrics.jsonl")):
        if r["event"] != "epoch":
            continue
        # precise BN changes the model: its time counts as training
        seconds = seconds + r["epoch_time"] + r.get("precise_bn_time", 0.0)
        cpu = cpu + r["cpu_time"] + r.get("precise_bn_cpu", 0.0)
        rows.append({"epoch": r["epoch"], "seconds": seconds, "cpu": cpu, "steps": r["step"],
                     "syncs": r["synchronisations"], "mfloats": r["allreduced_floats"] / 1e6,
                     "clips": r["clips"],
                     "top1": r["val_top1"], "loss": r["val_loss"], "train_loss": r["train_loss"]})
    return rows


def at_target(rows: list[dict], target: float) -> dict | None:
    return next((r for r in rows if r["top1"] >= target - 1e-9), None)


Curves = dict[int, list[dict]]  # a run's curve (``curve``) per repeat that finished


def summarise(runs: dict[str, Curves], targets: dict[int, float], baseline: str = "baseline") -> list[dict]:
    """Per variant: medians over repeats of the figures at the target and of the ratios to the
    ``baseline`` run of the same repeat (``targets``: that run's final top-1 per repeat)."""
    table = []
    for name, repeats in runs.items():
        hits = {i: at_target(rows, targets[i]) for i, rows in repeats.items() if i in targets}
        base = {i: at_target(runs[baseline][i], t) for i, t in targets.items()}
        finals = [rows[-1] for rows in repeats.values()]
        row = {"variant": name, "reached": sum(h is not None for h in hits.values()), "repeats": len(repeats),
               "final_top1": statistics.median(r["top1"] for r in finals),
               "best_top1": statistics.median(max(r["top1"] for r in rows) for rows in repeats.values()),
               "total_seconds": statistics.median(r["seconds"] for r in finals),
               "total_cpu": statistics.median(r["cpu"] for r in finals),
               "total_steps": statistics.median(r["steps"] for r in finals),
               "total_syncs": statistics.median(r["syncs"] for r in finals)}
        reached = [(h, base[i]) for i, h in hits.items() if h is not None and base[i] is not None]
        for key in ("seconds", "cpu", "steps", "syncs", "mfloats", "clips", "epoch"):
            if reached:
                row[key] = statistics.median(h[key] for h, _ in reached)
                row[f"{key}_ratio"] = statistics.median(h[key] / b[key] for h, b in reached)
        table.append(row)
    return table


def versus(runs: dict[str, Curves], targets: dict[int, float], names: list[str]) -> list[dict]:
    """Per variant, node-affine against global epochs of the same repeat (same seeds), over the
    repeats finished in both modes: medians of the final top-1 of each, and the paired differences
    (node - global) of the final top-1 and validation loss with their 95% t-intervals and signs
    (``paired.summary``); per repeat, the epochs each took to the target, and to the final top-1
    of the variant's global run."""
    table = []
    for name in names:
        g, n = runs[f"{name} global"], runs[f"{name} node"]
        both = sorted(set(g) & set(n))
        row = {"variant": name, "repeats": both,
               "global_top1": statistics.median(g[i][-1]["top1"] for i in both),
               "node_top1": statistics.median(n[i][-1]["top1"] for i in both)}
        for key in ("top1", "loss", "train_loss"):
            row[f"{key}_pairs"] = [(g[i][-1][key], n[i][-1][key]) for i in both]
            row[f"{key}_paired"] = paired.summary([b - a for a, b in row[f"{key}_pairs"]])
        for mode, repeats in (("global", g), ("node", n)):
            hits = [at_target(repeats[i], targets[i]) if i in targets else None for i in both]
            row[f"{mode}_epochs"] = [h["epoch"] if h else None for h in hits]
            hits = [at_target(repeats[i], g[i][-1]["top1"]) for i in both]
            row[f"{mode}_epochs_own"] = [h["epoch"] if h else None for h in hits]
        table.append(row)
    return table


def plot(runs: dict[str, Curves], target: float, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, key, label in zip(axes, ("seconds", "cpu"), ("training wall-clock (s), validation left out",
                                                           "training CPU seconds, both ranks and their "
                                                           "loaders")):
        for n, (name, repeats) in enumerate(runs.items()):
            for i, rows in enumerate(repeats.values()):
                ax.plot([r[key] for r in rows], [r["top1"] for r in rows], "o-", ms=3, color=f"C{n}",
                        alpha=0.9 if i == 0 else 0.35, label=name if i == 0 else None)
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.1f}%")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation top-1 (%)")
    axes[0].legend()
    fig.suptitle("motion data, TSM ResNet-10, 2 Horovod ranks on 2 shared CPU cores")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/kinetics-fast-schedules", help="data and runs")
    p.add_argument("--epochs", type=int, default=12,
                   help="the baseline's epochs (multigrid runs 1.5x as many)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1,
                   help="simulated nodes the ranks are spread over (horovodrun -H "
                        "localhost:R,127.0.0.1:R,...: one per name of this machine for loopback, "
                        "local_names)")
    p.add_argument("--shuffles", nargs="+", choices=("global", "node"), default=["global"],
                   help="each variant once per mode, same seeds (node needs --nodes 2): node-affine epochs "
                        "against global ones; the target is the global baseline's")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed-per-repeat", action="store_true",
                   help="repeat r trains with --seed r (the weights and the data order differ between "
                        "repeats: how far the final accuracy moves with them alone); default: seed 0, "
                        "repeats differ only in timings")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    p.add_argument("--train-per-class", type=int, default=64)
    p.add_argument("--val-per-class", type=int, default=32)
    p.add_argument("--speed-scale", type=float, default=0.5,
                   help="ingest synth's speeds times this (0.5: a 2-frame clip's disc moves at most "
                        "a radius)")
    p.add_argument("--precise-bn", type=int, default=16,
                   help="multigrid variants: BN statistics recomputed on this many full-shape batches per "
                        "rank before each validation (0: off)")
    p.add_argument("--from-runs", action="store_true",
                   help="train nothing: the tables of the runs already in WORK that finished (their log says "
                        "done), e.g. of a bench stopped partway")
    p.add_argument("--keep", action="store_true",
                   help="keep the runs in WORK that finished with the very command this call would start "
                        "(its record beside the log), training only the others: a campaign stopped partway, "
                        "or several calls sharing repeats (e.g. the baseline at 6 seeds, then variants at 2)")
    p.add_argument("--png", help="the plot (default: WORK/schedules.png)")
    p.add_argument("--json", help="also write every curve and the table here")
    args = p.parse_args()

    hosts(args.ranks, args.nodes)  # refused before any work
    work = Path(args.work)
    data = make_data(work, args.train_per_class, args.val_per_class, args.speed_scale)
    flags = variants(args.epochs, args.precise_bn)
    names = ["baseline"] + [v for v in args.variants if v != "baseline"]
    shuffles = sorted(set(args.shuffles))  # global first: the target's
    if "node" in shuffles and args.nodes < 2:
        raise SystemExit("--shuffles node: node-affine epochs on one node are global ones; add --nodes 2 (or "
                         "more)")
    # one run per variant and shuffle mode; named by the variant alone when there is one mode
    runs_of = {f"{v} {m}" if len(shuffles) > 1 else v: (v, m) for v in names for m in shuffles}
    runs: dict[str, Curves] = {r: {} for r in runs_of}
    walls: dict[str, dict[int, float]] = {r: {} for r in runs_of}  # of the runs trained by this call
    loads = []
    for repeat in range(args.repeats):
        for run, (name, shuffle) in runs_of.items():
            out = work / f"{run.replace(' ', '-')}-{repeat}"
            seed = ["--seed", str(repeat if args.seed_per_repeat else 0)]
            flags_run = run_flags(args.epochs, [*flags[name], *seed], shuffle)
            if args.from_runs:
                if not finished(out):
                    continue
            elif not (args.keep and finished(out, training_command(data, out, flags_run, args.ranks,
                                                                   hosts(args.ranks, args.nodes)))):
                loads.append(os.getloadavg()[0])
                walls[run][repeat] = train(data, out, flags_run, args.ranks, args.nodes)
            runs[run][repeat] = rows = curve(out)
            print(f"repeat {repeat} {run}: {rows[-1]['seconds']:.0f} s training ({rows[-1]['cpu']:.0f} CPU "
                  f"s), {rows[-1]['steps']} steps, "
                  f"{rows[-1]['syncs']} synchronisations, final top-1 {rows[-1]['top1']:.1f}%"
                  + (f" (whole run {walls[run][repeat]:.0f} s)" if repeat in walls[run] else " (kept)"),
                  flush=True)
    runs = {r: curves for r, curves in runs.items() if curves}  # --from-runs, --keep: those that finished
    baseline = next(iter(runs_of))
    if baseline not in runs:
        raise SystemExit(f"no finished {baseline} run in {work}: it sets the target")
    pairs = [v for v in names if f"{v} global" in runs and f"{v} node" in runs]
    targets = {i: rows[-1]["top1"] for i, rows in runs[baseline].items()}
    table = summarise(runs, targets, baseline)
    print(f"\ntarget: the {baseline} run's final validation top-1 "
          f"({', '.join(f'{t:.1f}%' for t in targets.values())})"
          + (f"; load average at the starts: median {statistics.median(loads):.1f}, max {max(loads):.1f}"
             if loads else ""))
    keys = (("seconds", "wall s to target"), ("cpu", "CPU s to target"), ("steps", "steps"),
            ("syncs", "syncs"), ("mfloats", "M floats sent"), ("clips", "clips"), ("epoch", "epoch"))
    print(f"{'variant':<16} | reached | " + " | ".join(f"{h + ' (x)':<16}" for _, h in keys)
          + " | final top-1 | whole run: wall s, CPU s, steps, syncs")
    for r in table:
        cells = [f"{r[k]:7.0f} ({r[k + '_ratio']:.2f}x)" if k in r else "not reached" for k, _ in keys]
        print(f"{r['variant']:<16} | {r['reached']}/{r['repeats']}     | "
              + " | ".join(f"{c:<16}" for c in cells)
              + f" | {r['final_top1']:10.1f}% | {r['total_seconds']:.0f}, {r['total_cpu']:.0f}, "
              f"{r['total_steps']:.0f}, {r['total_syncs']:.0f}")
    both = len(shuffles) > 1
    if both:
        print(f"\nnode-affine ({args.nodes} nodes of {args.ranks // args.nodes} rank(s)) against global "
              "epochs, same seeds, over the repeats finished in both modes; per repeat, final top-1 (global, "
              "node), epochs to the target and to the variant's global final top-1 (None: not reached)")
        for r in versus(runs, targets, pairs):
            pairs_top1 = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in r["top1_pairs"])
            print(f"{r['variant']}: repeats {r['repeats']}, final top-1 global/node {pairs_top1}, "
                  f"median {r['global_top1']:.1f}% / {r['node_top1']:.1f}%; epochs to target: global "
                  f"{r['global_epochs']}, node {r['node_epochs']}; to the global final: global "
                  f"{r['global_epochs_own']}, node {r['node_epochs_own']}")
            print(f"  node - global, final top-1: {paired.describe(r['top1_paired'], ' points')}")
            print(f"  node - global, final validation loss: {paired.describe(r['loss_paired'])}")
            print(f"  node - global, final training loss: {paired.describe(r['train_loss_paired'])}")
    png = args.png or str(work / "schedules.png")
    plot(runs, statistics.median(targets.values()), png)
    print(f"plot: {png}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"targets": targets, "loads": loads, "walls": walls, "runs": runs, "table": table,
                       "versus": versus(runs, targets, pairs) if both else None,
                       "nodes": args.nodes, "shuffles": shuffles,
                       "common": COMMON, "variants": {v: flags[v] for v in names}}, f, indent=1)


if __name__ == "__main__":
    main()
