"""Node-affine epochs and the node cache at scale: simulated on loopback, then the arithmetic at the
paper's scale.

Simulated (``--nodes`` x ``--ranks-per-node`` rank processes, all started at once, a cache
directory per node, ``--epochs`` epochs, against this project's shard service on 127.0.0.1): for
each of global and node-affine epochs, through a node cache with room for the whole set, through
one smaller than the set (``--small-budget`` of it: the dataset is larger than a node's budget),
reading byte ranges without a cache, and reading the set's files directly (``direct_reads=
"always"``: the service names the set's location, visible here with the same manifest, and no
shard byte goes through it). Reported: per rank the time to its first batch (epoch 1, and the
slowest later epoch), beside the time one shard takes to download from the service alone (the
median of 3 GETs), and the clips it trained each epoch (checked: every clip once per epoch over
all ranks); per node the bytes downloaded each epoch and the downloads per copy (from the
cache's own record of each download); the server's shard bytes and requests (its ``/v1/stats``
counters, before and after), peak memory and CPU seconds (psutil on its process). Without a
cache nothing is recorded per node: each epoch reads its share again, as byte ranges
(``shards.plan.layout.traffic`` counts them).

Then ``shards.plan.layout.traffic`` at the paper's scale (1,536 ranks on 256 nodes of 6, 240,000
clips of 150 kB, 100 epochs): bytes over the network per epoch and per run, the aggregate rate
from storage and the requests per second at the service at ``--epoch-seconds`` per epoch, in the
global and node-affine modes, for the shard counts of ``--paper-shards``.

    python bench/scale.py                    # 2 nodes x 2 ranks, 5 epochs; 6 min on 2 cores at load 22
    python bench/scale.py --paper-only       # the arithmetic alone (~30 s)

The last line of output is ``BENCH_JSON {...}`` with every figure.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import sys
import time
import urllib.request
from collections import Counter

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.service import make_set, start  # noqa: E402
from ingest.registry import describe_set  # noqa: E402
from shards.catalog import Catalog  # noqa: E402
from shards.plan import layout  # noqa: E402


class _Downloads(logging.Handler):
    """The node cache's record of each completed download, kept in the rank process."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.done: list[tuple[str, int]] = []

    def emit(self, record):
        if hasattr(record, "nbytes"):
            self.done.append((record.piece, record.nbytes))


def _rank(url, rank, world, per_node, mode, cache, budget, direct, crop, epochs, go, out):
    """One simulated rank: ``epochs`` epochs of its loader; per epoch its first-batch time, its
    valid clips and the downloads its node cache made in this process."""
    from trainer.data import ClipLoader, EpochOptions

    downloads = _Downloads()
    logging.getLogger("shards.read.cache").addHandler(downloads)
    logging.getLogger("shards.read.cache").setLevel(logging.INFO)
    try:
        epochs = EpochOptions(batch_size=4, rank=rank, world_size=world, local_size=per_node, shuffle=mode,
                              shuffle_buffer=16)
        loader = ClipLoader(url, "train", epochs, num_workers=0, crop_size=crop, scale_size=crop + crop // 8,
                            cache_dir=cache, cache_budget=budget, lookahead=2,
                            direct_reads="always" if direct else "never")
        go.wait()
        done = []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            t, first, keys, before = time.perf_counter(), None, [], len(downloads.done)
            for batch in loader:
                first = first if first is not None else time.perf_counter() - t
                keys += [k for k, ok in zip(batch["keys"], batch["valid"].tolist()) if ok]
            done.append({"first_batch_s": first, "keys": keys, "downloads": downloads.done[before:],
                         "seconds": time.perf_counter() - t})
        out.put((rank, done))
    except Exception as e:  # reported by the parent
        out.put((rank, repr(e)))


def served(url: str) -> dict:
    """The server's counters (``GET /v1/stats``), summed over its workers."""
    with urllib.request.urlopen(url.split("/v1/")[0] + "/v1/stats", timeout=60) as r:
        return json.loads(r.read())["total"]


def one_shard_s(url: str, name: str, times: int = 3) -> float:
    """The median time one whole shard takes to download from the service alone."""
    took = []
    for _ in range(times):
        t = time.perf_counter()
        with urllib.request.urlopen(f"{url}/{name}", timeout=300) as r:
            while r.read(1 << 20):
                pass
        took.append(time.perf_counter() - t)
    return statistics.median(took)


def simulate(url: str, work: str, nodes: int, per_node: int, mode: str, budget: int | None, cached: bool,
             direct: bool, server: psutil.Process, crop: int, clips: int, epochs: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    out, go = ctx.Queue(), ctx.Event()
    caches = [os.path.join(work, f"{mode}-{budget}-{cached}-node{n}") for n in range(nodes)]
    world = nodes * per_node
    procs = [ctx.Process(target=_rank, args=(url, r, world, per_node, mode, caches[r // per_node] if cached
                                             else None,
                                             budget, direct, crop, epochs, go, out)) for r in range(world)]
    for p in procs:
        p.start()
    before = served(url)
    cpu0 = server.cpu_times()
    peak = server.memory_info().rss
    go.set()
    got = {}
    while len(got) < world:
        try:
            rank, res = out.get(timeout=0.2)
            got[rank] = res
        except Exception:  # queue.Empty: sample the server meanwhile
            pass
        peak = max(peak, server.memory_info().rss)
    for p in procs:
        p.join()
    cpu1 = server.cpu_times()
    after = served(url)
    bad = {r: v for r, v in got.items() if isinstance(v, str)}
    if bad:
        raise RuntimeError(f"{mode}: ranks failed: {bad}")
    ranks = [got[r] for r in range(world)]
    per_epoch_clips = [Counter(k for r in ranks for k in r[e]["keys"]) for e in range(epochs)]
    every_clip_once = all(len(c) == clips and set(c.values()) == {1} for c in per_epoch_clips)
    node_rows = []
    for n in range(nodes):
        mine = ranks[n * per_node:(n + 1) * per_node]
        per_copy = Counter(name for r in mine for e in r for name, _ in e["downloads"])
        node_rows.append({"bytes_per_epoch": [sum(b for r in mine for _, b in r[e]["downloads"])
                                              for e in range(epochs)],
                          "downloads": sum(per_copy.values()), "copies": len(per_copy),
                          "max_downloads_per_copy": max(per_copy.values(), default=0)})
    return {
        "mode": mode, "cache": cached, "budget": budget, "direct": direct, "every_clip_once": every_clip_once,
        "first_batch_s": [r[0]["first_batch_s"] for r in ranks],
        "later_first_batch_s_max": [max(e["first_batch_s"] for e in r[1:]) for r in ranks],
        "clips_per_rank_per_epoch": [[len(e["keys"]) for e in r] for r in ranks],
        "epoch_s_max": [max(r[e]["seconds"] for r in ranks) for e in range(epochs)],
        "nodes": node_rows,
        "downloaded_bytes": sum(sum(n["bytes_per_epoch"]) for n in node_rows),
        "server_shard_bytes": after["shard_bytes"] - before["shard_bytes"],
        "server_requests": after["requests"] - before["requests"] - 1,  # less the /v1/stats that read them
        "server_shard_requests": after["shard_requests"] - before["shard_requests"],
        "server_peak_rss_mb": peak / 1e6, "server_cpu_s": (cpu1.user + cpu1.system)
        - (cpu0.user + cpu0.system),
    }


def paper(shard_counts: list[int], epoch_seconds: float, epochs: int) -> list[dict]:
    clips, clip_bytes, nodes, per_node = 240_000, 150e3, 256, 6
    rows = []
    for count in shard_counts:
        sizes = [clips * (j + 1) // count - clips * j // count for j in range(count)]
        t = layout.traffic(sizes, clip_bytes, nodes, per_node, epochs, batch_size=8)
        for mode, v in t["modes"].items():
            run = sum(v["bytes"])
            requests = v["requests"] and sum(v["requests"])
            rows.append({"shards": count, "mode": mode, "run_TB": run / 1e12, "x_dataset": run
                         / t["dataset_bytes"],
                         "epoch1_GB": v["bytes"][0] / 1e9, "later_epoch_GB": max(v["bytes"][1:]) / 1e9,
                         "epoch1_GB_s": v["bytes"][0] / 1e9 / epoch_seconds,
                         "mean_GB_s": run / 1e9 / (epochs * epoch_seconds),
                         "requests_per_s_epoch1": v["requests"] and v["requests"][0] / epoch_seconds,
                         "requests_run": requests})
        rows[-1]["node_share_MB"] = t["node_share_bytes"] / 1e6
    return rows


def report_paper(rows: list[dict], epoch_seconds: float, epochs: int) -> str:
    lines = [f"At the paper's scale: 240,000 clips x 150 kB (36 GB), 1,536 ranks on 256 nodes of 6, {epochs} "
             f"epochs of {epoch_seconds:g} s", "",
             f"{'shards':>6} {'mode':<56} {'run TB':>7} {'x set':>6} {'ep.1 GB':>8} {'later GB':>8} "
             f"{'ep.1 GB/s':>9} {'run GB/s':>8} {'req/s ep.1':>10}"]
    for r in rows:
        req = (f"{r['requests_per_s_epoch1']:>10,.0f}" if r["requests_per_s_epoch1"] is not None
               else f"{'-':>10}")
        lines.append(f"{r['shards']:>6} {r['mode']:<56} {r['run_TB']:>7.2f} {r['x_dataset']:>6.1f} "
                     f"{r['epoch1_GB']:>8.1f} {r['later_epoch_GB']:>8.1f} {r['epoch1_GB_s']:>9.2f} "
                     f"{r['mean_GB_s']:>8.3f} {req}")
    return "\n".join(lines)


def label(r: dict) -> str:
    how = ("direct reads, no cache" if r["direct"]
           else f"cache, budget {r['budget'] / 1e6:.0f} MB" if r["budget"]
           else "cache, no budget" if r["cache"] else "byte ranges, no cache")
    return f"{r['mode']:<6} {how}"


def report_sim(rows: list[dict], clips: int, set_mb: float, shard_s: float) -> str:
    lines = [f"{clips} clips, {set_mb:.0f} MB; per node MB downloaded in each epoch; first batch s (max over "
             f"ranks), one shard's download alone {shard_s:.3f} s"]
    for r in rows:
        nodes = "; ".join("/".join(f"{b / 1e6:.0f}" for b in n["bytes_per_epoch"]) +
                          f" ({n['downloads']} downloads of {n['copies']} copies)" for n in r["nodes"]
                          if r["cache"])
        lines.append(f"{label(r):<34} first batch {max(r['first_batch_s']):.2f} s "
                     f"({max(r['first_batch_s']) / shard_s:.1f}x one shard's download; later "
                     f"{max(r['later_first_batch_s_max']):.2f}), epoch {max(r['epoch_s_max']):.1f} s; "
                     f"clips/rank {r['clips_per_rank_per_epoch'][0]}; every clip once: "
                     f"{r['every_clip_once']}; nodes: {nodes or '-'}; cache total "
                     f"{r['downloaded_bytes'] / 1e6:.0f} MB; server sent {r['server_shard_bytes'] / 1e6:.0f} "
                     f"MB of shards in {r['server_shard_requests']} requests ({r['server_requests']} in "
                     f"all), peak {r['server_peak_rss_mb']:.0f} MB, {r['server_cpu_s']:.2f} CPU s")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/kinetics-fast-bench-scale", help="working directory (rebuilt)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--clips", type=int, default=24, help="clips per shard (~160 kB each)")
    p.add_argument("--small-budget", type=float, default=0.6,
                   help="the small cache budget, as a fraction of the set")
    p.add_argument("--crop", type=int, default=64,
                   help="the loaders' crop (small: the CPU is not what is measured)")
    p.add_argument("--paper-shards", type=int, nargs="+", default=[130, 256, 512])
    p.add_argument("--paper-epochs", type=int, default=100)
    p.add_argument("--epoch-seconds", type=float, default=9.0,
                   help="an epoch at the paper's scale (15 min / 100)")
    p.add_argument("--paper-only", action="store_true")
    args = p.parse_args()
    res = {}
    if not args.paper_only:
        shutil.rmtree(args.out, ignore_errors=True)
        root = os.path.join(args.out, "set")
        m = make_set(root, args.shards, args.clips)
        shards = m.splits["train"].shards
        set_bytes = sum(s.bytes for s in shards)
        cat = Catalog(os.path.join(args.out, "catalog.sqlite"))
        claim = cat.claim("5c" * 32, source="bench", location=root, options={}, name="bench")
        splits, files, sha = describe_set(root)
        cat.finish(claim.record.id, claim.owner, splits=splits, files=files, manifest_sha256=sha,
                   builder_version="bench")
        proc, url = start([sys.executable, "-m", "service", "serve", "--port", "0", "--catalog", cat.path])
        rows = []
        try:
            server = psutil.Process(proc.pid)
            base = url + "/v1/datasets/bench"
            small = int(args.small_budget * set_bytes)
            shard_s = one_shard_s(base, shards[0].name)
            for mode in ("global", "node"):
                for cached, budget, direct in ((True, None, False), (True, small, False),
                                               (False, None, False), (False, None, True)):
                    rows.append(simulate(base, args.out, args.nodes, args.ranks_per_node, mode,
                                         budget, cached, direct, server, args.crop,
                                         len(shards) * args.clips, args.epochs))
                    print(report_sim(rows[-1:], len(shards) * args.clips, set_bytes / 1e6,
                                     shard_s).splitlines()[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait()
        res["simulated"] = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "shards": args.shards,
                            "epochs": args.epochs, "clips": len(shards) * args.clips, "set_bytes": set_bytes,
                            "shard_bytes": shards[0].bytes, "one_shard_download_s": shard_s,
                            "small_budget": small, "rows": rows}
        print()
        print(report_sim(rows, len(shards) * args.clips, set_bytes / 1e6, shard_s))
        print()
    res["paper"] = paper(args.paper_shards, args.epoch_seconds, args.paper_epochs)
    print(report_paper(res["paper"], args.epoch_seconds, args.paper_epochs))
    print("BENCH_JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
