"""The paper's comparison of TSM with the 2D and 3D networks of its time, reproduced in one run.

"Training Kinetics in 15 Minutes" (Lin, Gan and Han, 2019) argues for TSM against I3D: TSM runs as
a 2D network with a shift of no multiply-adds, keeping every frame in every block, where an I3D pays
for 3D convolutions. Three parts, for TSM, TSN (``--arch tsn``) and the two I3D ResNet-50s of
``trainer/model/i3d.py`` (``--arch i3d-3x3x3``, ``i3d-3x1x1``), plus SlowFast's ``i3d_nopool`` (the
3x1x1 kernels without the temporal pool, ``nopool``) where it explains a difference:

1. **The table** at the paper's size (8 frames, 224 px, ResNet-50, 400 classes): parameters,
   multiply-adds per clip (torch's ``FlopCounterMode`` on one forward pass in evaluation mode: its
   FLOPs are 2 x the multiply-adds of every convolution and matrix product; BN, ReLU, pooling and the
   shift's copies are not counted) and the temporal resolution each block outputs (conv1, then each
   bottleneck of res2-res5), beside the paper's figures.
2. **Training throughput**: the trainer's own step (``Engine.train_step``: forward, loss, backward,
   SGD update, schedule) of each network on the same fixed random uint8 clips, the networks
   interleaved step by step (a neighbour's load hits all of them alike); medians give clips/s and
   each network's throughput as a fraction of TSM's (the paper: TSM 1.6x I3D 3x3x3, 2.9x I3D 3x1x1).
   The default is this CPU at a small size (real ResNet-50 width, 112 px); on a GPU the paper's size
   is ``--size 224 --batch 32 --amp bf16 --channels-last`` (``--compile`` adds the compiled path).
3. **Scaling** (``bench/scaling.py``'s model, Summit's assumptions): each network's gradient bytes
   (its parameters x 4, fp32) and a single-GPU step of scaling.py's assumed V100 TSM step (46 ms for
   8 clips) times the network's measured step-time ratio to TSM, predicted at 1,536 GPUs.

    nice -n 10 python bench/models.py --threads 1          # the table, then the CPU throughput
    nice -n 10 python bench/models.py --table-only         # the table alone (a minute)
    python bench/models.py --size 224 --batch 32 --amp bf16 --channels-last --steps 20   # a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import scaling
import torch
from torch.utils.flop_counter import FlopCounterMode
from train import interleaved_steps

from trainer.config import ARCHS, Model, Recipe, System
from trainer.distributed.backends import Backend
from trainer.engine import NAMES, Engine
from trainer.model.tsm import ModelConfig, build

# nopool: SlowFast's i3d_nopool, the I3D 3x1x1 keeping all T frames in every stage
MEASURED = (*ARCHS, "nopool")
# the paper's figures for its 8-frame ResNet-50s as issue 32 quotes them (the paper's own table could not be
# read from this machine): throughput against TSM's, temporal resolution, multiply-adds; and the TSM paper's
# (ICCV 2019)
PAPER = {"tsm": "every frame in every block; 33 G, 24.3 M (TSM paper)", "tsn": "33 G, 24.3 M (TSM paper)",
         "i3d-3x3x3": "time shrinks in later stages; ~33 G; TSM 1.6x its throughput",
         "i3d-3x1x1": "time kept; TSM 2.9x its throughput", "nopool": ""}
STAGES = ("conv1", "res2", "res3", "res4", "res5")


def network(arch: str, frames: int, depth: int, width: int, classes: int) -> torch.nn.Module:
    """``arch`` (``MEASURED``) as the trainer builds it."""
    torch.manual_seed(0)
    model = build(ModelConfig(num_classes=classes, segments=frames, depth=depth, width=width,
                              arch=trainer_arch(arch)))
    return keep_time(model, arch).eval()


def trainer_arch(arch: str) -> str:
    return "i3d-3x1x1" if arch == "nopool" else arch


def keep_time(model: torch.nn.Module, arch: str) -> torch.nn.Module:
    """``model``, without its temporal pool if ``arch`` is ``nopool`` (the same parameters: the pool has
    none)."""
    if arch == "nopool":
        model.backbone.pooled_after = ()
    return model


def describe(model: torch.nn.Module, frames: int, size: int) -> dict:
    """Parameters, multiply-adds of one clip, and each block's output time steps (a 2D network's are
    the frames of its (N*T, C, H, W) activations, an I3D's the T of its (N, C, T, H, W) ones)."""
    steps: dict[str, int] = {}

    def record(name):
        def hook(module, inputs, output):
            steps[name] = output.shape[2] if output.dim() == 5 else output.shape[0]
        return hook

    blocks = [("conv1", model.backbone.conv1)] + [
        (f"res{stage + 1}.{i}", block) for stage in (1, 2, 3, 4)
        for i, block in enumerate(getattr(model.backbone, f"layer{stage}"))]
    hooks = [m.register_forward_hook(record(name)) for name, m in blocks]
    clip = torch.randint(0, 256, (1, frames, 3, size, size), dtype=torch.uint8)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(clip)
    for h in hooks:
        h.remove()
    per_stage = {s: [t for name, t in steps.items() if name.split(".")[0] == s] for s in STAGES}
    temporal = sum(1 for m in model.modules() if isinstance(m, torch.nn.Conv3d) and m.kernel_size[0] > 1)
    return {"params": sum(p.numel() for p in model.parameters()), "macs": counter.get_total_flops() / 2,
            "steps": per_stage, "temporal_convs": temporal}


def table(args) -> dict:
    rows = {}
    print(f"ResNet-{args.depth} width {args.width}, {args.frames} frames x {args.table_size} px, "
          f"{args.classes} classes; multiply-adds of one clip's forward pass (torch's FlopCounterMode / 2)")
    print(f"{'network':<12} {'params':>8} {'GMACs':>7} {'3D convs':>8}  time steps out of conv1 / each block "
          f"of res2..res5{'':<6} the paper (issue 32)")
    for arch in MEASURED:
        r = rows[arch] = describe(network(arch, args.frames, args.depth, args.width, args.classes),
                                  args.frames, args.table_size)
        blocks = " / ".join(" ".join(map(str, r["steps"][s])) for s in STAGES)
        print(f"{label(arch):<12} {r['params'] / 1e6:7.2f}M {r['macs'] / 1e9:7.1f} {r['temporal_convs']:8d}  "
              f"{blocks:<44} {PAPER[arch]}")
    return rows


def label(arch: str) -> str:
    return "I3D nopool" if arch == "nopool" else NAMES[arch]


def engine(args, arch: str) -> Engine:
    torch.manual_seed(0)
    e = Engine(Backend(), args.classes, epoch_clips=10**7,
               model=Model(arch=trainer_arch(arch), depth=args.depth, width=args.width, segments=args.frames),
               recipe=Recipe(epochs=1, warmup_epochs=0),
               system=System(amp=args.amp, channels_last=True if args.channels_last else None,
                             compile=args.compile),
               batch_size=args.batch)
    keep_time(e.model, arch).train()
    return e


def throughput(args) -> dict:
    """Each network's training step, the networks taking turns (TSM, TSN, I3D 3x3x3, I3D 3x1x1, TSM, ...):
    median step time and clips/s, and TSM's throughput over each network's as the median over the
    rounds of the two steps' ratio (a round's steps share the machine's load). On the CPU also the CPU
    seconds of each step (all threads), whose ratio is the one taken (``tsm_speedup``): on a shared
    machine it is what a step costs, where the wall time is mostly the wait for a core."""
    engines = {arch: engine(args, arch) for arch in MEASURED}
    device = engines["tsm"].device
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.frames, 3, args.size, args.size), dtype=torch.uint8,
                      generator=g)
    y = torch.randint(0, args.classes, (args.batch,), generator=g)
    times, cpu, _ = interleaved_steps(engines, x.to(device), y.to(device), args.warmup, args.steps)

    def ratio(samples: dict, arch: str) -> float:
        return statistics.median(a / t for a, t in zip(samples[arch], samples["tsm"]))

    out = {}
    for arch in MEASURED:
        step = statistics.median(times[arch])
        out[arch] = {"step_ms": 1e3 * step, "clips_per_s": args.batch / step,
                     "wall_ratio": ratio(times, arch),
                     "steps_ms": [1e3 * t for t in times[arch]],
                     "params": sum(p.numel() for p in engines[arch].model.parameters())}
        if device.type == "cpu":
            out[arch] |= {"cpu_s": statistics.median(cpu[arch]), "cpu_ratio": ratio(cpu, arch)}
        out[arch]["tsm_speedup"] = out[arch]["cpu_ratio" if device.type == "cpu" else "wall_ratio"]
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU ({torch.get_num_threads()} threads)")
    print(f"\n{name}: ResNet-{args.depth} width {args.width}, {args.frames} x {args.size} px, batch "
          f"{args.batch}, amp {engines['tsm'].amp}, channels-last {args.channels_last}, compile "
          f"{args.compile}; medians of {args.steps} interleaved training steps after {args.warmup}; TSM's "
          f"throughput over each network's")
    for arch in MEASURED:
        r = out[arch]
        line = (f"  {label(arch):<10} {r['step_ms']:9.1f} ms/step {r['clips_per_s']:8.2f} clips/s  "
                f"TSM {r['wall_ratio']:.2f}x (steps {min(r['steps_ms']):.0f}-{max(r['steps_ms']):.0f} ms)")
        if "cpu_s" in r:
            line += f"   {r['cpu_s']:7.2f} CPU s/step  TSM {r['cpu_ratio']:.2f}x"
        print(line)
    return {"device": name, **out}


def predicted_scaling(measured: dict, gpus: int = 1536) -> dict:
    """``bench/scaling.py`` at ``gpus`` GPUs for each network: its gradient, and the assumed V100 TSM step
    times the measured ratio (fp32 and fp16 gradients, allreduce overlapped with the backward pass)."""
    base = scaling.parser().parse_args([])
    print(f"\nbench/scaling.py at {gpus} GPUs (Summit's assumptions; TSM's V100 step {base.step_ms:.0f} ms "
          f"for {base.batch} clips, the others' scaled by the measured ratio), allreduce overlapped:")
    out = {}
    for arch in MEASURED:
        a = scaling.parser().parse_args([])
        a.params, a.step_ms = measured[arch]["params"], base.step_ms * measured[arch]["tsm_speedup"]
        row = out[arch] = {"params": a.params, "gradient_mib": a.params * 4 / 2**20, "step_ms": a.step_ms}
        for fp16 in (False, True):
            t, t_ar = scaling.step_ms(gpus, a, fp16, overlap=True)
            row["fp16" if fp16 else "fp32"] = {"allreduce_ms": t_ar, "efficiency": a.step_ms / t,
                                               "clips_per_s": gpus * a.batch / t * 1e3}
        print(f"  {label(arch):<10} gradient {row['gradient_mib']:6.1f} MiB, step {a.step_ms:6.1f} ms: "
              f"{100 * row['fp32']['efficiency']:3.0f}% efficiency, {row['fp32']['clips_per_s']:8.0f} "
              f"clips/s (fp16 gradients: {100 * row['fp16']['efficiency']:3.0f}%, "
              f"{row['fp16']['clips_per_s']:8.0f} clips/s)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=50)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--classes", type=int, default=400)
    p.add_argument("--table-size", type=int, default=224, help="crop side of the table, in pixels")
    p.add_argument("--table-only", action="store_true", help="no throughput measurement")
    p.add_argument("--size", type=int, default=112, help="crop side of the throughput measurement, in pixels")
    p.add_argument("--batch", type=int, default=2, help="clips per step")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", nargs="?", const="auto",
                   help="torch.compile the networks (trainer --compile)")
    p.add_argument("--steps", type=int, default=7, help="timed steps per network")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per network first")
    p.add_argument("--threads", type=int,
                   help="intra-op threads (default torch's: the cores); 1 on a shared CPU, "
                   "where waiting threads of a parallel region spin and count as CPU seconds")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"args": vars(args), "torch": torch.__version__, "load_average": os.getloadavg()}
    result["table"] = table(args)
    if not args.table_only:
        result["throughput"] = throughput(args)
        result["scaling"] = predicted_scaling(result["throughput"])
        result["load_average_after"] = os.getloadavg()
        print(f"load average {' '.join(f'{v:.1f}' for v in result['load_average'])} before, "
              f"{' '.join(f'{v:.1f}' for v in result['load_average_after'])} after")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
