"""Horovod Elastic: how often to commit, against the work a failure loses and what a commit costs.

``--kill`` (the default): for each ``--commit-every`` value, one ``trainer elastic`` job of three
ranks on this machine (three names of 127.0.0.1, gloo, the tiny TSM of the tests, no DataLoader
workers); rank 1 is killed with SIGKILL as it starts step ``--kill-at`` of the first epoch and does not
come back. From the survivors' log and the clip log: the steps they redid (their last commit to
the kill), the seconds from the kill to their first step as two, and the time a commit took.

``--commit-cost``: what one commit copies (weights and optimizer state, deep-copied in memory;
the loader position and counters are a few hundred bytes) for a model given by the trainer's
flags, e.g. ``--depth 50 --width 64`` for TSM ResNet-50, timed on this machine's device.

    python bench/elastic.py                                   # commit every 1, 4, 16; kill at step 10
    python bench/elastic.py --commit-cost --depth 50 --width 64

The data is a synthetic shard set made with the tests' ``shardsets.make_shardset`` (``--data`` to
use your own). The last line of output is ``BENCH_JSON {...}``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from trainer.clip_log import read, read_file  # noqa: E402

HOSTS = ["localhost", "127.0.0.1", "127.1"]
LOST = re.compile(r"rank (\d+): a rank failed; .*: (\d+) steps lost")
COMMITS = re.compile(r"rank (\d+) of \d+: finished with (\d+) commits \(([\d.]+) ms each\)")


def kill_run(data: str, out: Path, commit_every: int, kill_at: int, gloo_timeout: int) -> dict:
    hosts, log = out.with_suffix(".hosts"), out.with_suffix(".log")
    hosts.write_text("".join(f"{h}:1\n" for h in HOSTS))
    job = subprocess.Popen([
        str(Path(sys.executable).parent / "horovodrun"), "-np", "3", "--min-np", "2", "--max-np", "3",
        "--gloo", "--gloo-timeout-seconds", str(gloo_timeout),
        "--host-discovery-script", f"{ROOT / 'scripts' / 'discover-hosts.sh'} {hosts}",
        sys.executable, "-m", "trainer", "elastic", "--data", data, "--output-dir", str(out),
        "--val-split", "", "--segments", "4", "--depth", "10", "--width", "8", "--crop-size", "32",
        "--scale-size", "36", "--batch-size", "2", "--epochs", "1", "--workers", "0", "--no-tensorboard",
        "--print-freq", "1000", "--commit-every", str(commit_every), "--clip-log"],
        # a pipe could fill
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log.open("w"), stderr=subprocess.STDOUT)
    killed = None
    while killed is None and job.poll() is None:
        for path in (out / "clips").glob("*.jsonl"):
            if any(r["rank"] == 1 and r["batch"] >= kill_at for r in read_file(str(path))):
                os.kill(int(path.stem.rsplit("-", 1)[1]), signal.SIGKILL)
                killed = time.time()
                break
        time.sleep(0.005)
    job.wait(timeout=600)
    output = log.read_text()
    if job.returncode != 0 or killed is None:
        raise SystemExit(f"commit every {commit_every}: job failed (rc {job.returncode}):\n{output[-3000:]}")
    records = read(str(out))
    first = min(r["generation"] for r in records)
    resumed = min(r["time"] for r in records if r["generation"] > first)
    lost = sorted({int(n) for _, n in LOST.findall(output)})
    commits = [(int(n), float(ms)) for _, n, ms in COMMITS.findall(output)]
    steps = [r for r in records if r["generation"] == first and r["rank"] == 0]
    return {"commit_every": commit_every, "killed_at_step": max(r["batch"] for r in records if r["rank"] == 1
                                                                 and r["generation"] == first),
            "steps_lost": lost, "recovery_s": round(resumed - killed, 2),
            "commit_ms": round(statistics.mean(ms for _, ms in commits), 2),
            "commits": max(n for n, _ in commits),
            "step_ms": round(1e3 * statistics.median(b["time"] - a["time"] for a, b in zip(steps, steps[1:])),
                             1)}


def commit_cost(flags: list[str], repeats: int) -> dict:
    import torch

    from trainer import config
    from trainer.distributed.backends import Backend
    from trainer.engine import Engine

    # the benchmark's trainer flags
    cfg = config.train_config(config.parser().parse_args(["--data", "-", *flags]))
    d = cfg.data
    engine = Engine(Backend(), 400, 100, model=cfg.model, recipe=cfg.recipe, system=cfg.system,
                    batch_size=d.batch_size)
    clips = torch.randint(0, 256, (d.batch_size, cfg.model.segments, 3, d.crop_size, d.crop_size),
                          dtype=torch.uint8)
    engine.train_step(clips, torch.zeros(d.batch_size, dtype=torch.int64))  # the optimizer now holds momentum
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        copy.deepcopy({"model": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict()})
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    tensors = list(engine.model.state_dict().values()) + [
        t for s in engine.optimizer.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]
    return {"device": str(engine.device), "flags": flags, "megabytes": round(sum(t.numel() * t.element_size()
                                                                                 for t in tensors) / 1e6, 1),
            "commit_ms_median": round(1e3 * statistics.median(times), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commit-cost", action="store_true", help="time a commit's copy instead of killing ranks")
    p.add_argument("--commit-every", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--kill-at", type=int, default=10, help="the step of the first epoch rank 1 is killed at")
    p.add_argument("--gloo-timeout", type=int, default=20)
    p.add_argument("--data", help="shard set (default: 120 synthetic clips)")
    p.add_argument("--repeats", type=int, default=5)
    args, model_flags = p.parse_known_args()
    if args.commit_cost:
        result = commit_cost(model_flags, args.repeats)
        print(f"commit of {result['megabytes']} MB ({' '.join(model_flags)}) on {result['device']}: "
              f"{result['commit_ms_median']} ms")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            data = args.data
            if data is None:
                from helpers.shardsets import make_shardset
                data = os.path.join(tmp, "data")
                make_shardset(data, {"train": 120}, per_shard=6, num_classes=3, frames=4, size=(48, 40))
            rows = [kill_run(data, Path(tmp) / f"every{n}", n, args.kill_at, args.gloo_timeout)
                    for n in args.commit_every]
        print("commit every | killed at step | steps lost | recovery s | commits | ms per commit | ms per "
              "step")
        for r in rows:
            print(f"{r['commit_every']:12d} | {r['killed_at_step']:14d} | "
                  f"{'/'.join(map(str, r['steps_lost'])):10s} | {r['recovery_s']:10.1f} | {r['commits']:7d} "
                  f"| {r['commit_ms']:13.1f} | {r['step_ms']:11.1f}")
        result = {"rows": rows}
    print("BENCH_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
