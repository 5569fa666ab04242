"""GPU JPEG decoding (nvJPEG through torchvision, ``--decode-on-device``) against CPU decoding,
on the same clips of a shard set, in one run. Needs a CUDA GPU and torchvision.

1. CPU: decode + TSM train transform of each clip's JPEG bytes held in memory, one process:
   clips/s per CPU core (the work of one loader worker; ``bench/loader`` shows that a worker
   streaming shards gets close to it).
2. GPU: ``trainer.data.device_decode.DeviceClips`` on whole batches already packed by the loader
   (bytes in host memory): nvJPEG decode of all B x T frames, then crop, resize and flip of
   every clip. Its clips/s over (1) is the number of CPU cores the GPU decode stands in for.
3. End to end: the real ``ClipLoader`` with W worker processes streaming the shards, (a) CPU
   decoding and the uint8 batch copied to the GPU, (b) ``decode_on_device=True``: workers only
   parse JPEG headers, the GPU decodes. Counted from each epoch's second batch (worker start
   left out), median over epochs.

It also checks that both paths give the same clips: the first batch of (3a) against (3b), mean
and largest absolute difference in 8-bit levels (nvJPEG's IDCT and chroma upsampling and
torch's resize round differently from libjpeg-turbo and PIL; a wrong crop or flip is tens off).

    python bench/decode.py --data SHARDS [--batch-size 32] [--workers 1 4] [--epochs 5]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from trainer.data import ClipLoader, EpochOptions
from trainer.data.device_decode import DeviceClips
from trainer.data.transforms import TrainTransform


def packed_batches(args) -> list[dict]:
    """One epoch of the loader's ``decode_on_device`` batches, kept in memory."""
    loader = ClipLoader(args.data, "train", EpochOptions(batch_size=args.batch_size, remainder="drop"),
                        num_workers=2, decode_on_device=True)
    return list(loader)


def clip_jpegs(batch: dict) -> list[list[bytes]]:
    data, offsets, t = batch["jpeg_data"].numpy().tobytes(), batch["jpeg_offsets"].tolist(), batch["frames"]
    frames = [data[a:b] for a, b in zip(offsets, offsets[1:])]
    return [frames[i:i + t] for i in range(0, len(frames), t)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_rate(batches: list[dict], passes: int) -> float:
    """Clips/s of one process decoding and transforming in-memory clips: the best pass."""
    clips = [c for b in batches for c in clip_jpegs(b)]
    transform, best = TrainTransform(), 0.0
    for _ in range(passes):
        start = time.perf_counter()
        for i, c in enumerate(clips):
            transform(c, random.Random(i))
        best = max(best, len(clips) / (time.perf_counter() - start))
    return best


def gpu_rate(batches: list[dict], device: torch.device, passes: int) -> float:
    """Clips/s of DeviceClips on packed batches: the median pass, after one warm-up pass."""
    clips_of = DeviceClips(device)
    rates = []
    for i in range(passes + 1):
        sync(device)
        start = time.perf_counter()
        for b in batches:
            clips_of(b)
        sync(device)
        if i:
            rates.append(sum(len(b["keys"]) for b in batches) / (time.perf_counter() - start))
    return statistics.median(rates)


def loader_rate(args, workers: int, on_device: bool, device: torch.device) -> float:
    """Clips/s of ClipLoader with ``workers`` processes into GPU clips: median over epochs."""
    loader = ClipLoader(args.data, "train", EpochOptions(batch_size=args.batch_size, remainder="drop"),
                        num_workers=workers, decode_on_device=on_device)
    clips_of = DeviceClips(device) if on_device else (lambda b: b["clips"].to(device, non_blocking=True))
    rates = []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        n, start = 0, None
        for batch in loader:
            clips_of(batch)
            if start is None:
                sync(device)
                start = time.perf_counter()
            else:
                n += len(batch["keys"])
        sync(device)
        if n:
            rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


def agreement(args, device: torch.device) -> dict:
    """Mean and largest |difference| between the first batch decoded on the CPU and on the device."""
    epochs, kw = EpochOptions(batch_size=args.batch_size, remainder="drop"), dict(num_workers=1)
    on_cpu = next(iter(ClipLoader(args.data, "train", epochs, **kw)))
    raw = next(iter(ClipLoader(args.data, "train", epochs, decode_on_device=True, **kw)))
    assert on_cpu["keys"] == raw["keys"]
    diff = (DeviceClips(device)(raw).cpu().int() - on_cpu["clips"].int()).abs().float()
    return {"mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="shard-set directory or manifest URL (train split)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="loader workers for (3)")
    p.add_argument("--epochs", type=int, default=5, help="epochs per end-to-end loader")
    p.add_argument("--passes", type=int, default=5, help="passes over the in-memory clips")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    device = torch.device(args.device)

    batches = packed_batches(args)
    first = clip_jpegs(batches[0])[0]
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
           "clips": sum(len(b["keys"]) for b in batches), "batch_size": args.batch_size,
           "frame_bytes": sum(map(len, first)) / len(first),
           "cpu_clips_per_s_per_core": cpu_rate(batches, args.passes),
           "gpu_clips_per_s": gpu_rate(batches, device, args.passes), "loader": {}}
    res["cores_replaced"] = res["gpu_clips_per_s"] / res["cpu_clips_per_s_per_core"]
    res["agreement"] = agreement(args, device)
    for w in args.workers:
        res["loader"][w] = {"cpu": loader_rate(args, w, False, device),
                            "gpu": loader_rate(args, w, True, device)}

    print(f"{res['device']}: {res['clips']} clips of {len(first)} frames ({res['frame_bytes'] / 1e3:.1f} kB "
          f"each), batch {args.batch_size}, TSM train transform to 224")
    print(f"  in memory: CPU {res['cpu_clips_per_s_per_core']:.0f} clips/s per core; GPU "
          f"{res['gpu_clips_per_s']:.0f} clips/s = {res['cores_replaced']:.1f} CPU cores")
    print(f"  same clips: mean |CPU - device| {res['agreement']['mean_abs_diff']:.2f} levels, "
          f"largest {res['agreement']['max_abs_diff']:.0f}")
    for w, r in res["loader"].items():
        print(f"  ClipLoader, {w} worker(s): CPU decode {r['cpu']:.0f} clips/s, decode on device "
              f"{r['gpu']:.0f} clips/s ({r['gpu'] / r['cpu']:.1f}x)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
