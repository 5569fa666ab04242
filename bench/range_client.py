"""The range client: today's (``shards.io.http_range``, the standard library's ``http.client`` with a
per-process connection pool) against urllib3 (pooling, retries, backoff, ``Retry-After`` and
redirects built in), reading the same random clip ranges from the same nginx (sendfile, the
cheapest server here, so the clients' own costs show), one after the other, alternated.

    python bench/range_client.py                 # 8 threads, 6 s per client, 3 rounds

Reports MB/s and the client process's CPU seconds per GB (user and kernel) per round and the
medians; every answer's length is checked and one in 20 compared byte for byte. The last line is
``BENCH_JSON {...}``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import urllib3  # noqa: E402

from bench.service import make_set, start_nginx  # noqa: E402
from shards.read.reading import open_range  # noqa: E402


def stdlib_read(url: str, a: int, b: int, s) -> bytes:
    with open_range(url, a, b, size=s.bytes, sha256=s.sha256) as f:
        return f.read()


def urllib3_reader():
    pool = urllib3.PoolManager(maxsize=16, retries=urllib3.Retry(total=5, backoff_factor=0.25,
                                                                  respect_retry_after_header=True))

    def read(url: str, a: int, b: int, s) -> bytes:
        r = pool.request("GET", url, headers={"Range": f"bytes={a}-{b - 1}"}, preload_content=True)
        if r.status != 206 or r.headers.get("Content-Range", "").split("/")[0] != f"bytes {a}-{b - 1}":
            raise OSError(f"status {r.status}")
        return r.data
    return read


def run(read, base: str, m, root: str, threads: int, seconds: float) -> dict:
    shards = m.splits["train"].shards
    counts = []
    deadline = time.perf_counter() + seconds

    def client(seed):
        rng, nbytes, n = random.Random(seed), 0, 0
        while time.perf_counter() < deadline:
            s = rng.choice(shards)
            i = rng.randrange(s.num_samples)
            j = min(s.num_samples, i + rng.randint(1, 8))
            a, b = s.offsets[i], s.offsets[j - 1] + s.lengths[j - 1]
            data = read(f"{base}/{s.name}", a, b, s)
            assert len(data) == b - a
            n += 1
            if n % 20 == 0:
                with open(os.path.join(root, s.name), "rb") as f:
                    f.seek(a)
                    assert f.read(b - a) == data
            nbytes += b - a
        counts.append(nbytes)
    cpu, t = os.times(), time.perf_counter()
    ts = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    wall, now = time.perf_counter() - t, os.times()
    gb = sum(counts) / 1e9
    return {"MB_s": gb * 1e3 / wall, "cpu_s_per_GB": (now.user - cpu.user + now.system - cpu.system) / gb,
            "sys_s_per_GB": (now.system - cpu.system) / gb}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/kinetics-fast-bench-client", help="working directory (rebuilt)")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--seconds", type=float, default=6)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    root = os.path.join(args.out, "set")
    m = make_set(root, 8, 100)
    proc, base = start_nginx(args.out, 2, f"root {root};")
    res = {"stdlib (shards.io.http_range)": [], "urllib3 PoolManager": []}
    try:
        clients = {"stdlib (shards.io.http_range)": stdlib_read, "urllib3 PoolManager": urllib3_reader()}
        for r in range(args.rounds):
            for label, read in clients.items():
                res[label].append(run(read, base, m, root, args.threads, args.seconds))
                print(f"round {r + 1} {label}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in res[label][-1].items()), flush=True)
    finally:
        proc.terminate()
        proc.wait()
    med = {label: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for label, rows in res.items()}
    for label, v in med.items():
        print(f"median {label}: " + ", ".join(f"{k} {x:.2f}" for k, x in v.items()))
    print("BENCH_JSON " + json.dumps({"rounds": res, "median": med, "urllib3": urllib3.__version__},
                                     sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
