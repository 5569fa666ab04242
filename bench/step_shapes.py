"""What one training step of the network costs at each multigrid shape, without the loader.

Forward, backward and an SGD step of a TSM ResNet on random uint8 clips in the loader's
channels-last layout, one thread, CPU seconds per step (median of ``--repeats`` x ``--steps``),
for the shapes of ``bench/schedules.py``'s long cycle (clips x frames x crop, per rank) with one BN
group and with groups of ``--bn-group`` clips. Set beside the trainer's CPU seconds per step
(metrics.jsonl), it tells how much of a step is the network and how much the data.

    PYTHONPATH=. python bench/step_shapes.py
    PYTHONPATH=. python bench/step_shapes.py --depth 50 --width 64 --shapes 8x8x224 32x2x158
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainer.model.tsm import build


def step_ms(model, optimizer, clips: int, frames: int, crop: int, steps: int) -> float:
    x = torch.randint(0, 255, (clips, frames, crop, crop, 3), dtype=torch.uint8).permute(0, 1, 4, 2, 3)
    y = torch.randint(0, model.config.num_classes, (clips,))
    start = time.process_time()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return (time.process_time() - start) / steps * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["2x8x32", "16x2x23", "8x4x23", "4x4x32"],
                   help="CLIPSxFRAMESxCROP per rank")
    p.add_argument("--depth", type=int, default=10)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--bn-group", type=int, default=2, help="clips per BN group (multigrid's default: the "
                                                           "base batch per rank)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    frames = max(t for _, t, _ in shapes)
    for group in (0, args.bn_group):
        model = build({"num_classes": 4, "segments": frames, "depth": args.depth, "width": args.width},
                      bn_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        times = {s: [] for s in shapes}
        for _ in range(args.repeats):  # shapes interleaved, so drifting load hits them alike
            for s in shapes:
                times[s].append(step_ms(model, optimizer, *s, args.steps))
        for (b, t, c), ms in times.items():
            print(f"BN groups of {group or b} clips | {b} x {t} x {c}² | {b * t} frames | "
                  f"{statistics.median(ms):6.1f} ms CPU per step")


if __name__ == "__main__":
    main()
