"""Viewer benchmark: the viewer's JSON pages on a Kinetics-sized set, timed over loopback.

A synthetic manifest of CLASSES classes and CLIPS training clips (plus a val split a twentieth
of that) in shards of about 256 MB, with Kinetics-style keys, offsets and lengths (no shard
bytes are written: these routes read the manifest alone), is registered in a catalog and served
by ``shard-service serve``. Then, one request at a time: the set page's JSON the first time
(which parses the manifest and indexes it) and again, the largest page of clips (per_page 200)
at the start and at the end of the split, a page filtered by one class, and a class's last page.
Reported per request: the answer's bytes and the median time of REPEATS, beside the manifest's
size, which the browser never downloads, and the server's memory (RSS) at the end.

    python bench/viewer.py                        # 400 classes, 240,000 clips
    python bench/viewer.py --clips 24000 --repeats 5

The last line of output is ``BENCH_JSON {...}`` with every figure.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import statistics
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.service import start  # noqa: E402  (the service started as bench/service.py starts it)
from ingest.registry import describe_set  # noqa: E402
from shards.catalog import Catalog  # noqa: E402
from shards.format.manifest import Manifest, ShardInfo, SplitInfo  # noqa: E402
from shards.format.packing import shard_name  # noqa: E402

SHARD_BYTES = 256 * 10**6


def synthetic_split(split: str, clips: int, classes: int, rng: random.Random) -> SplitInfo:
    """Shards of about SHARD_BYTES of ~150 kB clips with random labels, as ``ingest build`` lists them."""
    out, shard = SplitInfo(), None
    for i in range(clips):
        if shard is None or shard.bytes >= SHARD_BYTES:
            shard = ShardInfo(name=shard_name(split, len(out.shards)), num_samples=0, bytes=0,
                              sha256=f"{rng.getrandbits(256):064x}")
            out.shards.append(shard)
        length = 512 * rng.randint(200, 400)
        yid = "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
                      for _ in range(11))
        shard.keys.append(f"{yid}_{rng.randint(0, 300):06d}_{rng.randint(300, 600):06d}_c00")
        shard.offsets.append(shard.bytes)
        shard.lengths.append(length)
        shard.labels.append(rng.randrange(classes))
        shard.bytes += length
        shard.num_samples += 1
    return out


def get(conn: http.client.HTTPConnection, path: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    conn.request("GET", path)
    answer = conn.getresponse()
    body = answer.read()
    if answer.status != 200:
        raise RuntimeError(f"{path}: HTTP {answer.status}: {body[:200]!r}")
    return time.perf_counter() - t0, len(body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/kinetics-fast-bench-viewer", help="working directory (rebuilt)")
    p.add_argument("--classes", type=int, default=400)
    p.add_argument("--clips", type=int, default=240_000, help="training clips")
    p.add_argument("--repeats", type=int, default=20,
                   help="requests timed per figure (the median is reported)")
    args = p.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    root = os.path.join(args.out, "set")
    rng = random.Random(0)
    classes = [f"class {c:03d} " + "".join(rng.choice("abcdefghij") for _ in range(12))
               for c in range(args.classes)]
    m = Manifest(classes=classes, fingerprint="bench", config={"clip": {"frames": 8}},
                 splits={"train": synthetic_split("train", args.clips, args.classes, rng),
                         "val": synthetic_split("val", args.clips // 20, args.classes, rng)})
    m.save(root)
    with open(os.path.join(root, "classes.txt"), "w") as f:
        f.write("".join(c + "\n" for c in classes))
    manifest_bytes = os.path.getsize(os.path.join(root, "manifest.json"))
    cat = Catalog(os.path.join(args.out, "catalog.sqlite"))
    claim = cat.claim("be" * 32, source="bench", location=root, options={}, name="k400")
    splits, files, sha = describe_set(root)
    cat.finish(claim.record.id, claim.owner, splits=splits, files=files, manifest_sha256=sha,
               builder_version="bench")
    print(f"{args.classes} classes, {args.clips:,} training clips in {len(m.splits['train'].shards)} shards; "
          f"manifest.json {manifest_bytes / 1e6:.1f} MB", flush=True)

    proc, url = start([sys.executable, "-m", "service", "serve", "--port", "0", "--catalog", cat.path])
    try:
        host, port = url.split("//")[1].split("/")[0].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        last = args.clips // 200
        one_class = sum(1 for s in m.splits["train"].shards for label in s.labels if label == 7)
        res = {"manifest_MB": manifest_bytes / 1e6, "clips": args.clips, "classes": args.classes}
        res["set_page_first"] = dict(zip(("ms", "bytes"), get(conn, "/v1/viewer/k400")))
        res["set_page_first"]["ms"] *= 1e3
        requests = {"set_page": "/v1/viewer/k400",
                    "clips_page_200_first": "/v1/viewer/k400/clips?split=train&per_page=200",
                    "clips_page_200_last": f"/v1/viewer/k400/clips?split=train&per_page=200&page={last - 1}",
                    "class_page_200": "/v1/viewer/k400/clips?split=train&class=7&per_page=200",
                    "class_page_200_last": f"/v1/viewer/k400/clips?split=train&class=7&per_page=200"
                                           f"&page={(one_class - 1) // 200}"}
        for name, path in requests.items():
            times = [get(conn, path) for _ in range(args.repeats)]
            res[name] = {"ms": statistics.median(t for t, _ in times) * 1e3, "bytes": times[0][1]}
        res["server_rss_MB"] = psutil.Process(proc.pid).memory_info().rss / 2**20
    finally:
        proc.terminate()
        proc.wait()
    for name, r in res.items():
        if isinstance(r, dict):
            print(f"{name:>22}: {r['bytes'] / 1e3:8.1f} kB in {r['ms']:8.1f} ms")
    print(f"server RSS after indexing the set: {res['server_rss_MB']:.0f} MiB")
    print("BENCH_JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
