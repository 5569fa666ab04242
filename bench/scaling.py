"""Predicted data-parallel scaling of TSM-ResNet-50 from a measured step time and the gradient size.

Weak scaling: every GPU keeps its per-GPU batch, so N GPUs would ideally give N times the
clips/s of one. What they lose is the gradient allreduce (if not hidden behind the backward
pass) and waiting for the slowest GPU. The model, every term stated:

Step time of one GPU alone, ``t1`` = forward + backward + update, measured (``--step-ms``,
or read from ``bench/train.py --json``); the backward pass is ``--backward-fraction`` of it.

Allreduce of S bytes (Horovod's hierarchical ring on G GPUs per node, p nodes):
    t_ar = 2 (G-1)/G * S / B_intra        reduce-scatter + all-gather inside a node (NVLink)
         + 2 (p-1)/p * S / B_node         ring across nodes: every node sends and receives
                                          2 (p-1)/p of S through its network adapters
         + 2 log2(p) * alpha              latency, with tree-shaped inter-node steps
         + ceil(S / fusion) * overhead    one fused Horovod operation per fusion buffer
S = parameters x 4 bytes (fp32) or x 2 (``--fp16-allreduce`` compression).

Step time on N GPUs:
    no overlap:  t_N = t1 + t_ar + straggle
    overlap:     t_N = t1 + max(0, t_ar - t_bwd) + tail + straggle; gradients are reduced
                 while later layers still run backward; ``tail`` is the allreduce of what the
                 last Horovod cycle (``--cycle-ms``) collects after the backward pass ends
    straggle = t1 * cv * sqrt(2 ln N): expected wait for the slowest of N GPUs whose step
               times vary with coefficient of variation ``--cv`` (Gaussian extreme value)
Efficiency = t1 / t_N; clips/s = N x batch / t_N. Data loading is assumed never to stall.

Defaults describe Summit, the machine of "Training Kinetics in 15 Minutes" (1,536 V100s, 8
clips per GPU, reported scaling efficiency above 80%): 6 V100 per node on NVLink 2.0
(50 GB/s between neighbouring GPUs), two EDR InfiniBand rails per node (2 x 12.5 GB/s,
of which 90% is achievable), alpha 5 us; Horovod's defaults of 64 MB fusion buffers and a
5 ms cycle. Without a V100 measurement, the default step time is 46 ms: 64 frames (8 clips
x 8) at the ~1,400 images/s that NVIDIA publishes for ResNet-50 training with mixed
precision on one V100; pass a measured figure with ``--step-ms`` or ``--bench-json``.
"""
from __future__ import annotations

import argparse
import json
import math

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024, 1536)


def allreduce_ms(size_bytes: float, gpus: int, a) -> float:
    g = min(gpus, a.gpus_per_node)
    p = math.ceil(gpus / a.gpus_per_node)
    t = 2 * (g - 1) / g * size_bytes / (a.nvlink_gbs * 1e9)
    if p > 1:
        t += 2 * (p - 1) / p * size_bytes / (a.node_gbs * a.achievable * 1e9)
        t += 2 * math.log2(p) * a.alpha_us * 1e-6
    t += math.ceil(size_bytes / (a.fusion_mb * 2**20)) * a.op_overhead_us * 1e-6
    return 1e3 * t


def step_ms(gpus: int, a, fp16: bool, overlap: bool) -> tuple[float, float]:
    """(step time in ms on ``gpus`` GPUs, allreduce time in ms)."""
    size = a.params * (2 if fp16 else 4)
    t_ar = allreduce_ms(size, gpus, a)
    straggle = a.step_ms * a.cv * math.sqrt(2 * math.log(gpus))
    if not overlap:
        return a.step_ms + t_ar + straggle, t_ar
    backward = a.step_ms * a.backward_fraction
    tail = t_ar * min(1.0, a.cycle_ms / backward)
    return a.step_ms + max(0.0, t_ar - backward) + tail + straggle, t_ar


def parser() -> argparse.ArgumentParser:
    """The model's assumptions as flags (``parser().parse_args([])``: Summit's, for ``bench/models.py``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=46.0, help="measured single-GPU step time")
    p.add_argument("--bench-json",
                   help="take step time and batch from bench/train.py --json (its TSM figure)")
    p.add_argument("--batch", type=int, default=8, help="clips per GPU per step")
    p.add_argument("--params", type=float, default=24.3e6, help="gradient elements (TSM-R50, 400 classes)")
    p.add_argument("--backward-fraction", type=float, default=2 / 3,
                   help="share of the step spent in backward")
    p.add_argument("--gpus-per-node", type=int, default=6)
    p.add_argument("--nvlink-gbs", type=float, default=50.0, help="GB/s between neighbouring GPUs in a node")
    p.add_argument("--node-gbs", type=float, default=25.0, help="GB/s per node and direction, all rails")
    p.add_argument("--achievable", type=float, default=0.9, help="fraction of --node-gbs a ring reaches")
    p.add_argument("--alpha-us", type=float, default=5.0, help="latency per inter-node step")
    p.add_argument("--fusion-mb", type=float, default=64.0, help="Horovod fusion buffer")
    p.add_argument("--op-overhead-us", type=float, default=100.0, help="fixed cost per fused operation")
    p.add_argument("--cycle-ms", type=float, default=5.0, help="Horovod cycle time")
    p.add_argument("--cv", type=float, default=0.02, help="step-time variation between GPUs")
    p.add_argument("--json", help="also write the table here")
    return p


def main() -> None:
    a = parser().parse_args()
    source = "assumed (see --help)"
    if a.bench_json:
        with open(a.bench_json, encoding="utf-8") as f:
            bench = json.load(f)
        a.step_ms, a.batch = bench["TSM"]["step_ms"], bench["batch"]
        source = f"measured on {bench['device']}"

    variants = {f"{'fp16' if fp16 else 'fp32'}{' overlap' if overlap else ''}": (fp16, overlap)
                for fp16 in (False, True) for overlap in (False, True)}
    print(f"single-GPU step {a.step_ms:.1f} ms for {a.batch} clips ({source}): "
          f"{1e3 * a.batch / a.step_ms:.0f} clips/s; gradient {a.params / 1e6:.1f} M elements "
          f"({a.params * 4 / 2**20:.0f} MiB fp32)")
    print(f"{'GPUs':>5} {'nodes':>5} " + " ".join(f"{name:>22}" for name in variants))
    print(f"{'':>11} " + " ".join(f"{'ar ms  eff  clips/s':>22}" for _ in variants))
    rows = []
    for n in GPU_COUNTS:
        row = {"gpus": n, "nodes": math.ceil(n / a.gpus_per_node)}
        cells = []
        for name, (fp16, overlap) in variants.items():
            t, t_ar = step_ms(n, a, fp16, overlap)
            eff = a.step_ms / t
            row[name] = {"allreduce_ms": t_ar, "step_ms": t, "efficiency": eff, "clips_per_s": n * a.batch
                         / t * 1e3}
            cells.append(f"{t_ar:5.1f} {100 * eff:4.0f}% {row[name]['clips_per_s']:9.0f}")
        rows.append(row)
        print(f"{n:>5} {row['nodes']:>5} " + " ".join(f"{c:>22}" for c in cells))
    last = rows[-1]
    print(f"at {last['gpus']} GPUs: {100 * last['fp32 overlap']['efficiency']:.0f}% (fp32, overlapped) and "
          f"{100 * last['fp16 overlap']['efficiency']:.0f}% (fp16, overlapped) predicted, against the "
          f"paper's reported > 80%; without overlap {100 * last['fp32']['efficiency']:.0f}% / "
          f"{100 * last['fp16']['efficiency']:.0f}%")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"assumptions": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
