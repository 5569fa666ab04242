"""Reading a shard set at scale: where the bytes come from and what each source costs, one row per
way of reading, the same set read whole in each (the server's side; ``bench/scale.py`` has the
clients': node-affine epochs and the node cache).

Structure (kept simple so columns can be added by anyone): ``SCENARIOS`` maps a row's name to a
function ``(ctx) -> dict`` of its figures; ``COLUMNS`` lists (key, header, format) in the order
printed; a figure a row has not got prints as ``-``. ``ctx`` holds the set (local directory,
manifest) and the servers started for the run. A client-side figure belongs in the row's dict
like a server-side one.

The server's columns (from the service's own counters, ``GET /v1/stats``, and psutil on all its
processes): the shard bytes and the requests it carried, its peak memory and its CPU seconds.
Rows: the service as the source; behind a caching proxy (nginx's ``proxy_cache``, Debian's),
first and second read of the set by id; with ``--redirect`` for a set in an object store (moto's
S3 server on loopback: presigned URLs); with direct reads of a set whose files are visible here.
Targets: no shard byte through the service with redirects or direct reads, and none on the
second read by id behind the proxy.

    python bench/scale_server.py            # 4 shards of 25 clips (~48 MB)

The last line is ``BENCH_JSON {...}``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.service import Server, make_set, start, start_nginx  # noqa: E402
from ingest.registry import describe_set  # noqa: E402
from shards.catalog import Catalog  # noqa: E402
from shards.read.direct import load_manifest  # noqa: E402
from shards.read.reading import iter_samples  # noqa: E402
from shards.tools.verify import stamps  # noqa: E402

COLUMNS = [("clips", "clips read", "{:,}"), ("wall_s", "client wall s", "{:.2f}"),
           ("server_shard_MB", "shard MB through the server", "{:.1f}"),
           ("server_requests", "server requests", "{:,}"), ("server_rss_peak_MB", "server peak RSS MB",
                                                            "{:.0f}"),
           ("server_cpu_s", "server CPU s", "{:.2f}")]
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{proc.args[0]} did not start") from None
            time.sleep(0.05)


def server_stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/stats") as r:
        return json.loads(r.read())["total"]


def read_set(url: str, direct: str = "never") -> dict:
    """Every sample of the set at ``url`` (checked against its digest), one range per shard."""
    t, clips = time.perf_counter(), 0
    m = load_manifest(url, direct)
    for split in m.splits.values():
        for s in split.shards:
            clips += sum(1 for _ in iter_samples(m.shard_url(s), s, 0, s.num_samples))
    return {"clips": clips, "wall_s": time.perf_counter() - t}


def measured(server_url: str, server: Server, read) -> dict:
    """``read()``'s figures and what the server did meanwhile."""
    before, cpu0, rss, done = server_stats(server_url), server.cpu_times(), [server.rss()], threading.Event()

    def sample():
        while not done.wait(0.1):
            rss.append(server.rss())
    threading.Thread(target=sample, daemon=True).start()
    try:
        out = read()
    finally:
        done.set()
    after, cpu1 = server_stats(server_url), server.cpu_times()
    return {**out, "server_shard_MB": (after["shard_bytes"] - before["shard_bytes"]) / 1e6,
            "server_requests": after["requests"] - before["requests"] - 1,  # less the first /v1/stats
            "server_rss_peak_MB": max(rss) / 2**20, "server_cpu_s": sum(cpu1) - sum(cpu0)}


def service_source(ctx) -> dict:
    return measured(ctx["service"], ctx["server"],
                    lambda: read_set(f"{ctx['service']}/v1/datasets/{ctx['id']}"))


def proxy_first(ctx) -> dict:
    return measured(ctx["service"], ctx["server"],
                    lambda: read_set(f"{ctx['proxy']}/v1/datasets/{ctx['id']}"))


def proxy_second(ctx) -> dict:
    return proxy_first(ctx)


def redirects(ctx) -> dict:
    return measured(ctx["s3service"], ctx["s3server"],
                    lambda: read_set(f"{ctx['s3service']}/v1/datasets/ons3"))


def direct_reads(ctx) -> dict:
    return measured(ctx["service"], ctx["server"],
                    lambda: read_set(f"{ctx['service']}/v1/datasets/{ctx['id']}", "always"))


SCENARIOS = {"service as the source": service_source, "caching proxy, 1st read by id": proxy_first,
             "caching proxy, 2nd read by id": proxy_second, "redirects to S3 (moto, presigned)": redirects,
             "direct reads (visible path)": direct_reads}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/kinetics-fast-bench-scale", help="working directory (rebuilt)")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--clips", type=int, default=25, help="clips per shard")
    args = p.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    root = os.path.join(args.out, "set")
    m = make_set(root, args.shards, args.clips)
    cat = Catalog(os.path.join(args.out, "catalog.sqlite"))
    claim = cat.claim("5c" * 32, source="bench", location=root, options={}, name="local")
    splits, files, sha = describe_set(root)
    cat.finish(claim.record.id, claim.owner, splits=splits, files=files, manifest_sha256=sha,
               builder_version="bench", verified_files=stamps(m))
    ctx, procs = {"id": claim.record.id}, []
    try:
        port = free_port()  # moto's S3 server, the set uploaded, and a service redirecting to it
        moto = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H",
                                 "127.0.0.1",
                                 "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, **CREDS})
        procs.append(moto)
        wait_listening(port, moto)
        s3env = {**os.environ, **CREDS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        import s3fs
        fs = s3fs.S3FileSystem(endpoint_url=s3env["AWS_ENDPOINT_URL"], key="bench", secret="bench",
                               skip_instance_cache=True)
        fs.mkdir("bench-scale")
        fs.put(root, "bench-scale/set", recursive=True)
        s3cat = Catalog(os.path.join(args.out, "s3catalog.sqlite"))
        c = s3cat.claim("53" * 32, source="bench", location="s3://bench-scale/set", options={}, name="ons3")
        s3cat.finish(c.record.id, c.owner, splits=splits, files=files, manifest_sha256=sha,
                     builder_version="bench")
        for key, catalog, extra, env in (("service", cat, [], None), ("s3service", s3cat,
                                                                      ["--redirect", "600"], s3env)):
            proc, url = start([sys.executable, "-m", "service", "serve", "--port", "0",
                               "--catalog", catalog.path, *extra], env=env)
            procs.append(proc)
            ctx[key], ctx[key.replace("service", "server")] = url, Server(proc.pid)
        proxy, ctx["proxy"] = start_nginx(  # a caching proxy in front of the service
            args.out, 2, f"location / "
                         f"{{ proxy_pass {ctx['service']}; proxy_http_version 1.1; proxy_cache shards; }}",
            "proxy_cache_path PREFIX/cache keys_zone=shards:10m max_size=4g;")
        procs.append(proxy)
        rows = {}
        for name, scenario in SCENARIOS.items():
            rows[name] = scenario(ctx)
            print(name, rows[name], flush=True)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait()
    width = max(map(len, rows))
    print(f"{'':{width}} | " + " | ".join(h for _, h, _ in COLUMNS))
    for name, row in rows.items():
        print(f"{name:{width}} | " + " | ".join(fmt.format(row[k]) if k in row else "-" for k, _,
                                                fmt in COLUMNS))
    print("BENCH_JSON " + json.dumps(rows, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
