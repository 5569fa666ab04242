"""Training-step throughput of TSM against TSN (same network without the shift), in one run.

Runs the trainer's own step (``trainer.engine.Engine.train_step``: forward, loss, backward,
SGD update, schedule) on fixed random uint8 clips, so the data path is left out: this is the
compute side of the step. TSM and TSN steps alternate, so a neighbour's load on a shared
machine hits both alike; the median step time of each gives clips/s and the cost of the shift.

On a GPU it also reports peak memory and model FLOPs utilisation (MFU): model FLOPs per
clip (multiply-adds of every conv and linear layer x 2, x 3 for forward plus backward)
times clips/s, divided by the matrix-multiply rate this GPU measures in the same dtype.
``--max-batch`` first searches the largest batch that fits (less 5% headroom).

    python bench/train.py                                     # CPU: small TSM vs TSN
    python bench/train.py --depth 50 --width 64 --size 224 --frames 8 --amp bf16 \\
        --channels-last --max-batch                           # GPU: the full TSM-ResNet-50
    ... --batch 177 --compile                                 # the same, torch.compile'd
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from trainer.config import Model, Recipe, System
from trainer.distributed.backends import Backend
from trainer.engine import Engine


def model_flops(model: nn.Module, clip: torch.Tensor) -> int:
    """Forward FLOPs for one clip: 2 x multiply-adds of every Conv2d and Linear."""
    total = 0

    def count(module, inputs, output):
        nonlocal total
        if isinstance(module, nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels // module.groups
            total += 2 * output.numel() * k
        elif isinstance(module, nn.Linear):
            total += 2 * output.numel() * module.in_features

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        model(clip)
    model.train(was_training)
    for h in hooks:
        h.remove()
    return total


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """FLOP/s of an n x n matrix multiply: the best of ``repeats`` timed rounds of 5."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 * 5 / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def engine(args, shift: bool, batch: int) -> Engine:
    torch.manual_seed(0)
    e = Engine(Backend(), args.classes, epoch_clips=10**7,
               model=Model(depth=args.depth, width=args.width, segments=args.frames, shift=shift),
               recipe=Recipe(epochs=1, warmup_epochs=0),
               system=System(amp=args.amp, channels_last=True if args.channels_last else None,
                             compile=args.compile),
               batch_size=batch)
    e.model.train()
    return e


def interleaved_steps(engines: dict[str, Engine], x: torch.Tensor, y: torch.Tensor, warmup: int,
                      steps: int) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    """Each engine's training step on the same batch, the engines taking turns step by step (a
    neighbour's load hits all alike): ``warmup`` untimed rounds, then ``steps`` timed ones. Returns,
    by name, the timed steps' seconds, the CPU seconds this process spent in them (all its threads:
    on a shared CPU, what the step cost rather than how long it waited for a core), and the first
    step's seconds (compilation included)."""
    device = next(iter(engines.values())).device
    times, cpu, first = {name: [] for name in engines}, {name: [] for name in engines}, {}
    for i in range(warmup + steps):
        for name, e in engines.items():
            sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            e.train_step(x, y)
            sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
            elif i == 0:
                first[name] = time.perf_counter() - start
    return times, cpu, first


def clips(args, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, args.frames, 3, args.size, args.size), dtype=torch.uint8, generator=g)
    y = torch.randint(0, args.classes, (batch,), generator=g)
    return x.to(device), y.to(device)


def fits(args, batch: int) -> bool:
    try:
        e = engine(args, True, batch)
        x, y = clips(args, batch, e.device)
        e.train_step(x, y)
        e.train_step(x, y)
        sync(e.device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def largest_batch(args) -> int:
    """Double until a step runs out of memory, bisect, then keep 5% headroom: a batch found at
    the very edge fails later on allocator fragmentation, and clips/s is flat near the top."""
    good, bad = 0, args.batch
    while fits(args, bad):
        good, bad = bad, bad * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(args, mid) else (good, mid)
    if not good:
        raise SystemExit(f"not even a batch of {args.batch} fits")
    return max(1, good * 19 // 20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=18)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--size", type=int, default=112, help="crop side in pixels")
    p.add_argument("--batch", type=int, default=8, help="clips per step (the start of the search with "
                                                        "--max-batch)")
    p.add_argument("--classes", type=int, default=400)
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--max-batch", action="store_true", help="use the largest batch that fits (GPU)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--compile", nargs="?", const="auto", help="torch.compile the network (trainer "
                   "--compile); the first step's extra time is reported as the start-up cost")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    batch = largest_batch(args) if args.max_batch else args.batch
    engines = {"TSM": engine(args, True, batch), "TSN": engine(args, False, batch)}
    device = engines["TSM"].device
    x, y = clips(args, batch, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, _, first = interleaved_steps(engines, x, y, args.warmup, args.steps)

    e = engines["TSM"]
    flops_per_clip = 3 * model_flops(e.model, x[:1])
    dtype = e.amp or torch.float32
    peak = matmul_rate(device, dtype, 8192 if device.type == "cuda" else 1536)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({torch.get_num_threads()} threads)"
    result = {"device": device_name, "depth": args.depth, "width": args.width, "frames": args.frames,
              "size": args.size, "batch": batch, "amp": str(e.amp), "channels_last": args.channels_last,
              "compile": args.compile, "torch": torch.__version__,
              "train_gflop_per_clip": flops_per_clip / 1e9, "matmul_tflops": peak / 1e12}
    for name, ts in times.items():
        step = statistics.median(ts)
        result[name] = {"step_ms": 1e3 * step, "clips_per_s": batch / step,
                        "mfu": batch / step * flops_per_clip / peak,
                        "startup_s": first[name] - step}  # compilation, with --compile
    result["shift_cost"] = result["TSM"]["step_ms"] / result["TSN"]["step_ms"] - 1
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(f"{device_name}: ResNet-{args.depth} width {args.width}, {args.frames} x {args.size}px, batch "
          f"{batch}, amp {e.amp}, channels-last {args.channels_last}; {flops_per_clip / 1e9:.2f} GFLOP per "
          f"clip (training), matmul {peak / 1e12:.2f} TFLOP/s")
    for name in engines:
        r = result[name]
        print(f"  {name}: {r['step_ms']:8.1f} ms/step {r['clips_per_s']:9.1f} clips/s  MFU "
              f"{100 * r['mfu']:5.1f}%  first step +{r['startup_s']:.1f} s")
    print(f"  shift cost: {100 * result['shift_cost']:+.1f}% step time"
          + (f"; peak memory {result['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in result else ""))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
