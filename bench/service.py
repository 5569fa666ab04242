"""Service benchmark: concurrent clients reading random shard ranges over loopback, beside the
same reads from local disk through the same client path (``shards.read.reading.open_range``).

For a fixed time, CLIENTS clients (PROCS processes x threads) each read random runs of 1-8
consecutive clips (the reads a loader makes) of random shards, and check every answer's length
(one in 20 byte for byte). Reported per source: MB/s, requests/s, latency p50/p99, errors; for
servers also their peak memory (RSS sampled every 0.2 s, with the first and last sample to show
it stays flat) and CPU seconds per GB served (with the share spent in the kernel), and for the clients
their CPU seconds per GB read (a server's CPU and memory are those of all its processes; behind
nginx, the service's and nginx's apart too). Sources,
in one run: local disk, this service (aiohttp, sendfile; ``--workers N`` processes), nginx with
``sendfile`` serving the same files (Debian's nginx-light, the reference static server; its
worker count is the service's), the service behind the shipped nginx configuration handing it
each file (X-Accel-Redirect) and granting clients the files for a minute (``service.grants``: nginx
checks the grant on every request, the client keeps it), and with --compare a Starlette
FileResponse app on uvicorn. Then
one epoch of the trainer's loader streamed from the service against local disk: the time spent
waiting for batches.

    python bench/service.py                      # 32 clients, 10 s per source
    python bench/service.py --workers 2 --no-epoch --seconds 8
    python bench/service.py --compare --seconds 8
    python bench/service.py --slowloris 1500 --seconds 10   # slow clients: the server's bounds off, then on
    python bench/service.py --shards 1 --clips 20 --request-cost 10000 --rounds 3   # server CPU a request

With ``--slowloris N`` it measures instead what N slowloris connections (from 127.0.0.2: a
request head sent a byte a second, reconnecting whenever the server closes them) do to normal
clients (from 127.0.0.1: 4 threads, a new connection per 1-clip range read, 5 s timeout), with
the server under a 1,024 open-files limit (a common host default, soft and hard): first with no
slow client, then with its bounds off (no header deadline, no connection caps), then with its defaults.

With ``--request-cost N`` it measures instead the server CPU one request costs, N GETs of a shard
one after another on a keep-alive connection with the headers nginx sends (the token,
``X-Sendfile-Type``, a range): the service deciding the file for nginx to send
(``--x-accel-redirect``, ``--read-auth``), and a bare aiohttp route answering the same headers with
no check (the least any aiohttp route costs), in turn, ``--rounds`` times.

The last line of output is ``BENCH_JSON {...}`` with every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import io
import json
import multiprocessing
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time

import fsspec.config
import numpy as np
import psutil
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from helpers.fronts import ACCEL_SECRET, accel_flags, free_port, front_config, grant_flags, write_secret  # noqa: E402

from ingest.registry import describe_set  # noqa: E402
from shards.catalog import Catalog  # noqa: E402
from shards.format.manifest import Manifest, SplitInfo  # noqa: E402
from shards.format.packing import shard_name, write_shard  # noqa: E402
from shards.format.tar import sample_bytes  # noqa: E402
from shards.read.reading import open_range  # noqa: E402


def make_set(directory: str, shards: int, clips: int, frames: int = 8) -> Manifest:
    """Shards of JPEG clips about the size of Kinetics ones (340x256 frames, ~20 kB each)."""
    rng = np.random.default_rng(0)
    jpegs = []
    for t in range(frames):
        a = (np.linspace(0, 255, 340)[None, :, None] + rng.normal(0, 40, (256, 340, 3))).clip(0, 255)
        buf = io.BytesIO()
        Image.fromarray(a.astype(np.uint8)).save(buf, "JPEG", quality=90)
        jpegs.append(buf.getvalue())
    split = SplitInfo()
    for k in range(shards):
        samples = []
        for i in range(clips):
            key = f"v{k:03d}_{i:04d}_c00"
            members = [(f"{t:02d}.jpg", jpegs[(t + i) % frames]) for t in range(frames)]
            members += [("cls", str(i % 10).encode()), ("json", b"{}")]
            samples.append((key, i % 10, sample_bytes(key, members)))
        name = shard_name("train", k)
        split.shards.append(write_shard(os.path.join(directory, name), name, samples))
    m = Manifest(classes=[f"c{i}" for i in range(10)], splits={"train": split},
                 config={"clip": {"frames": frames}},
                 fingerprint="bench")
    m.save(directory)
    return m


# --- clients ------------------------------------------------------------------------------------
def _client_thread(base, shards, deadline, seed, out, local_root):
    rng = random.Random(seed)
    lat, nbytes, errors, n = [], 0, 0, 0
    while time.perf_counter() < deadline:
        s = rng.choice(shards)
        i = rng.randrange(len(s["offsets"]))
        j = min(len(s["offsets"]), i + rng.randint(1, 8))
        a, b = s["offsets"][i], s["offsets"][j - 1] + s["lengths"][j - 1]
        t0 = time.perf_counter()
        try:
            with open_range(f"{base}/{s['name']}", a, b, size=s["bytes"], sha256=s["sha256"]) as f:
                data = f.read()
            if len(data) != b - a:
                raise OSError("short")
            n += 1
            if n % 20 == 0:
                with open(os.path.join(local_root, s["name"]), "rb") as f:
                    f.seek(a)
                    if f.read(b - a) != data:
                        raise OSError("bytes differ")
        except Exception:  # counted, reported
            errors += 1
            continue
        lat.append(time.perf_counter() - t0)
        nbytes += b - a
    out.append((lat, nbytes, errors))


def _client_proc(base, shards, seconds, threads, seed, queue, local_root):
    out = []
    cpu = os.times()  # this process's threads
    deadline = time.perf_counter() + seconds
    ts = [threading.Thread(target=_client_thread, args=(base, shards, deadline, seed * 1000 + k, out,
                                                        local_root))
          for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    now = os.times()
    queue.put((out, (now.user - cpu.user, now.system - cpu.system)))


class Server:
    """A server's processes (each top process and all its children) as one, for CPU and memory:
    the service and nginx in front of it are one server."""

    def __init__(self, *pids: int):
        self.tops = [psutil.Process(pid) for pid in pids]

    def procs(self) -> list[psutil.Process]:
        return [p for top in self.tops for p in (top, *top.children(recursive=True))]

    def cpu_times(self) -> tuple[float, float]:
        times = [p.cpu_times() for p in self.procs()]
        return sum(t.user for t in times), sum(t.system for t in times)

    def cpu_by_top(self) -> list[float]:
        """CPU seconds of each top process with its children (the service, the nginx in front)."""
        return [sum(sum(p.cpu_times()[:2]) for p in (top, *top.children(recursive=True)))
                for top in self.tops]

    def rss(self) -> int:
        return sum(p.memory_info().rss for p in self.procs())


def load(base: str, m: Manifest, local_root: str, clients: int, procs: int, seconds: float,
         server: Server | None) -> dict:
    shards = [{"name": s.name, "offsets": s.offsets, "lengths": s.lengths, "bytes": s.bytes,
               "sha256": s.sha256}
              for s in m.splits["train"].shards]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    cpu0, parts0 = (server.cpu_times(), server.cpu_by_top()) if server else (None, None)
    rss = []
    ps = [ctx.Process(target=_client_proc, args=(base, shards, seconds, clients // procs, k, queue,
                                                 local_root))
          for k in range(procs)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    results = []
    while len(results) < procs:
        if server:
            rss.append(server.rss())
        try:
            results.append(queue.get(timeout=0.2))
        except Exception:  # queue.Empty: sample again
            pass
    for p in ps:
        p.join()
    wall = time.perf_counter() - t0
    client_user, client_sys = (sum(cpu[k] for _, cpu in results) for k in (0, 1))
    results = [r for r, _ in results]
    lat = np.array([x for r in results for t in r for x in t[0]])
    nbytes = sum(t[1] for r in results for t in r)
    out = {"MB_s": nbytes / wall / 1e6, "req_s": len(lat) / wall,
           "p50_ms": float(np.percentile(lat, 50) * 1e3),
           "p99_ms": float(np.percentile(lat, 99) * 1e3), "errors": sum(t[2] for r in results for t in r),
           "requests": len(lat), "GB": nbytes / 1e9}
    gb = max(out["GB"], 1e-9)
    out.update({"client_cpu_s_per_GB": (client_user + client_sys) / gb, "client_sys_share": client_sys / max(
        client_user + client_sys, 1e-9), "load_avg_1min": os.getloadavg()[0]})
    if server:
        # once, so the figures are of the same interval
        cpu1, parts1 = server.cpu_times(), server.cpu_by_top()
        used = cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1]
        out.update({f"cpu_s_per_GB_process_{k}": (b - a) / gb
                    for k, (a, b) in enumerate(zip(parts0, parts1))})
        out.update({"rss_peak_MB": max(rss) / 2**20, "rss_first_MB": rss[0] / 2**20,
                    "rss_last_MB": rss[-1] / 2**20, "cpu_s_per_GB": used / gb,
                    "sys_share": (cpu1[1] - cpu0[1]) / max(used, 1e-9)})
    return out


# --- servers ------------------------------------------------------------------------------------
def start(cmd: list[str], env=None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        if line.startswith("serving "):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, line.split()[1].rstrip("/")  # the server's root URL (the viewer's)
    raise RuntimeError("server did not start")


NGINX = "/usr/sbin/nginx"


def start_nginx(workdir: str, workers: int, site: str, http_extra: str = "") -> tuple[subprocess.Popen, str]:
    """nginx on a free loopback port as ../shared/notes/nginx.md has it; ``site``: its server
    block's directives (``root DIR;`` for a static server), ``http_extra``: more in ``http``."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    prefix = os.path.join(workdir, "nginx")
    os.makedirs(prefix, exist_ok=True)
    conf = os.path.join(prefix, "nginx.conf")
    temps = " ".join(f"{k}_temp_path {prefix}/t{i};" for i, k in
                     enumerate(("client_body", "proxy", "fastcgi", "uwsgi", "scgi")))
    with open(conf, "w") as f:
        f.write(f"user root; worker_processes {workers}; daemon off; pid {prefix}/nginx.pid; "
                f"error_log {prefix}/error.log;\nevents {{ worker_connections 4096; }}\n"
                f"http {{ access_log off; sendfile on; tcp_nopush on; keepalive_requests 1000000; {temps}\n"
                f"  {http_extra.replace('PREFIX', prefix)}\n  server {{ listen 127.0.0.1:{port}; {site} }} "
                f"}}\n")
    proc = subprocess.Popen([NGINX, "-c", conf, "-p", prefix])
    wait_listening(proc, port, prefix)
    return proc, f"http://127.0.0.1:{port}"


def wait_listening(proc: subprocess.Popen, port: int, prefix: str) -> None:
    import socket

    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start (see {prefix}/error.log)") from None
            time.sleep(0.05)


def starlette_main(root: str) -> None:
    """A Starlette app serving ``root`` with FileResponse (which answers single ranges) on uvicorn."""
    import socket

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import FileResponse
    from starlette.routing import Route

    async def shard(request):
        return FileResponse(os.path.join(root, request.path_params["path"]))

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"serving http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    app = Starlette(routes=[Route("/{path:path}", shard)])
    uvicorn.Server(uvicorn.Config(app, log_level="warning", backlog=1024)).run(sockets=[sock])


# --- slow clients -----------------------------------------------------------------------------
def _slowloris(port: int, n: int, stop: threading.Event, stats: dict) -> None:
    """N connections from 127.0.0.2 sending a request head a byte a second, reopened when closed."""
    async def one():
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
            except OSError:
                await asyncio.sleep(0.5)
                continue
            stats["opened"] += 1
            try:
                writer.write(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                while not stop.is_set():
                    await asyncio.sleep(1)
                    if reader.at_eof():
                        break
                    writer.write(b"a")
                    await writer.drain()
            except OSError:
                pass
            stats["closed"] += not stop.is_set()
            writer.close()
            await asyncio.sleep(0.2)  # then again

    async def main():
        await asyncio.gather(*(one() for _ in range(n)))

    asyncio.run(main())


def _normal_client(port: int, path: str, deadline: float, out: list) -> None:
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path, headers={"Range": "bytes=0-99999"})
            answer = conn.getresponse()
            ok = answer.status == 206 and len(answer.read()) == 100000
            conn.close()
        except OSError:
            ok = False
        out.append((ok, time.perf_counter() - t0))


def slowloris(cat: Catalog, shard: str, n: int, seconds: float) -> dict:
    """Normal clients' figures with ``n`` slowloris connections open, the server's bounds off and on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds the N connections
    limit = ["prlimit", "--nofile=1024:1024"]
    serve = [sys.executable, "-m", "service", "serve", "--port", "0", "--catalog", cat.path]
    off = ["--header-timeout", "3630", "--max-connections", "0", "--max-connections-per-client", "0"]
    variants = {"no slow clients": ([], 0), "bounds off": (off, n), "bounds on (defaults)": ([], n)}
    res = {}
    for label, (flags, slow) in variants.items():
        proc, url = start(limit + serve + flags)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        stop, stats = threading.Event(), {"opened": 0, "closed": 0}
        attacker = threading.Thread(target=_slowloris, args=(port, slow, stop, stats))
        try:
            attacker.start()
            time.sleep(3)  # the connections open
            out: list = []
            deadline = time.perf_counter() + seconds
            path = f"/v1/datasets/bench/{shard}"
            clients = [threading.Thread(target=_normal_client, args=(port, path, deadline, out))
                       for _ in range(4)]
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            server = psutil.Process(proc.pid)
            held = sum(1 for c in server.net_connections("tcp") if c.raddr and c.raddr[0] == "127.0.0.2")
        finally:
            stop.set()
            attacker.join()
            proc.terminate()
            proc.wait()
        lat = np.array([t for ok, t in out if ok] or [float("nan")])
        res[label] = {"ok_req_s": sum(ok for ok, _ in out) / seconds, "failed": sum(not ok for ok, _ in out),
                      "p50_ms": float(np.percentile(lat, 50) * 1e3),
                      "p99_ms": float(np.percentile(lat, 99) * 1e3),
                      "slow_connections_held": held, "slow_opened": stats["opened"],
                      "slow_closed_by_server": stats["closed"]}
        print(f"{slow} slowloris connections, {label}: {res[label]}", flush=True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return res


# --- the sources, measured one at a time ---------------------------------------------------------
LOCAL = "local disk"
SERVICE = "service (aiohttp, sendfile)"
NGINX_ROW = "nginx (sendfile)"
ACCEL_ROW = "service + nginx sending the bytes (X-Accel)"
GRANT_ROW = "service granting, nginx checking (grants)"
GRANT_SECONDS = 60  # serve's default: a client process asks the service once a minute per shard


def accel_front(workdir: str, workers: int, upstream: str) -> tuple[subprocess.Popen, str]:
    """nginx in front of the service at ``upstream`` (host:port), sending files the service hands it
    (``service.accel``) or grants (``service.grants``, links in ``workdir``/grants):
    docker/nginx-replicas.conf with one replica and ``workers`` worker processes."""
    prefix, port = os.path.join(workdir, "front"), free_port()
    os.makedirs(prefix, exist_ok=True)
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as f:
        f.write(front_config(prefix, port, [upstream], os.path.join(workdir, "grants"))
                .replace("worker_processes auto;", f"worker_processes {workers};"))
    write_secret(prefix)
    proc = subprocess.Popen([NGINX, "-c", conf, "-p", prefix])
    wait_listening(proc, port, prefix)
    return proc, f"http://127.0.0.1:{port}"


def measure(label: str, serve: list[str] | None, args, root: str, m: Manifest) -> dict:
    """One source under the clients for ``args.seconds``; its servers started and stopped here."""
    if label == LOCAL:
        return load(root, m, root, args.clients, args.procs, args.seconds, None)
    procs = []
    try:
        if label == NGINX_ROW:
            procs.append(start_nginx(args.out, args.workers, f"root {root};"))
            base = procs[0][1]
        else:
            procs.append(start(serve))
            base = procs[0][1] + ("" if "--role" in serve else "/v1/datasets/bench")
        if label in (ACCEL_ROW, GRANT_ROW):
            procs.append(accel_front(args.out, args.workers, base.split("//")[1].split("/")[0]))
            base = procs[-1][1] + "/v1/datasets/bench"
        if label == GRANT_ROW and args.held_grants:  # granted here, kept by the forked clients
            for s in m.splits["train"].shards:
                open_range(f"{base}/{s.name}", 0, 1, size=s.bytes, sha256=s.sha256).read()
        return load(base, m, root, args.clients, args.procs, args.seconds, Server(*(p.pid for p, _ in procs)))
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait()


def median_row(rows: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in rows])) for k in rows[0]}


# --- what a cache check per request costs on a PostgreSQL catalog -------------------------------------
def catalog_cost(n: int) -> dict:
    """Per request, what the record cache pays to know whether the catalog changed, on PostgreSQL:
    the notifications' generation (``Catalog.generation``) against a query of a generation number
    (one round trip), each ``n`` times, on a server of the tests' own on loopback; CPU of this
    process and of the server's processes, and wall time, in microseconds per check."""
    from helpers.postgres import PostgresServer

    server = PostgresServer()
    out = {}
    try:
        cat = Catalog(server.start().database())
        cat.generation()  # the listener started
        db = Server(server.pid())
        checks = {"notifications (Catalog.generation)": cat.generation,
                  "a query per request (SELECT of a generation row)":
                      lambda: cat._db.execute("SELECT version FROM catalog_schema").fetchone()}
        for label, check in checks.items():
            check()
            cpu, server_cpu, wall = time.process_time(), sum(db.cpu_times()), time.perf_counter()
            for _ in range(n):
                check()
            out[label] = {"client_cpu_us": (time.process_time() - cpu) / n * 1e6,
                          "server_cpu_us": (sum(db.cpu_times()) - server_cpu) / n * 1e6,
                          "wall_us": (time.perf_counter() - wall) / n * 1e6,
                          "load_avg_1min": os.getloadavg()[0]}
            print(label, out[label], flush=True)
    finally:
        server.close()
    return out


# --- what one request costs the server --------------------------------------------------------
def bare_aiohttp_main() -> None:
    """The least an aiohttp route costs: one handler answering every GET with the headers of a
    handed-over file and no body; no middleware, no check."""
    import socket

    from aiohttp import web

    async def handed_over(request):
        return web.Response(headers={"ETag": '"bench"', "X-Accel-Redirect": "/_accel/bench"})

    app = web.Application()
    app.router.add_get("/{tail:.*}", handed_over)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections wait in its backlog until the app accepts them
    print(f"serving http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    web.run_app(app, sock=sock, print=None, access_log=None)


def request_cost(servers: dict[str, list[str]], path: str, token: str, n: int, rounds: int) -> dict:
    """Server CPU (all its processes) per request, in microseconds, for ``n`` GETs of ``path`` one
    after another on one keep-alive connection, with the headers nginx sends (the token,
    ``X-Sendfile-Type``, a range); each of ``servers`` (label: command) in turn, ``rounds`` times."""
    headers = {"Authorization": f"Bearer {token}", "X-Sendfile-Type": "X-Accel-Redirect",
               "X-Accel-Secret": ACCEL_SECRET, "Range": "bytes=0-999"}
    got: dict[str, list[float]] = {label: [] for label in servers}
    for r in range(rounds):
        for label, cmd in servers.items():
            proc, url = start(cmd)
            try:
                conn = http.client.HTTPConnection(*url.split("//")[1].split("/")[0].split(":"))
                for i in range(200 + n):  # the first 200 warm it up
                    if i == 200:
                        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                        cpu0 = sum(sum(p.cpu_times()[:2]) for p in tree)
                    conn.request("GET", path, headers=headers)
                    answer = conn.getresponse()
                    answer.read()
                    if answer.status != 200 or not answer.getheader("X-Accel-Redirect"):
                        raise RuntimeError(f"{label}: {answer.status}, no X-Accel-Redirect")
                got[label].append((sum(sum(p.cpu_times()[:2]) for p in tree) - cpu0) / n * 1e6)
                print(f"round {r + 1} {label}: {got[label][-1]:.0f} us of server CPU a request "
                      f"(load {os.getloadavg()[0]:.0f})", flush=True)
            finally:
                proc.terminate()
                proc.wait()
    return {label: {"cpu_us_per_request": float(np.median(v)), "range": [min(v), max(v)]} for label,
            v in got.items()}


# --- one epoch's data wait ----------------------------------------------------------------------
def epoch_wait(where: str, workers: int) -> dict:
    from trainer.data import ClipLoader, EpochOptions

    loader = ClipLoader(where, "train", EpochOptions(batch_size=8), num_workers=workers, crop_size=112,
                        scale_size=128)
    waits, t = [], time.perf_counter()
    for _ in loader:
        now = time.perf_counter()
        waits.append(now - t)
        t = now
    return {"data_wait_s": float(sum(waits)), "batches": len(waits)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/kinetics-fast-bench-service", help="working directory (rebuilt)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--procs", type=int, default=4, help="client processes (the clients are their threads)")
    p.add_argument("--seconds", type=float, default=10, help="load time per source")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--clips", type=int, default=100, help="clips per shard")
    p.add_argument("--workers", type=int, default=1, help="service processes (serve --workers), and nginx's")
    p.add_argument("--no-nginx", action="store_true", help="leave out the rows with nginx")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every source this many times, interleaved (each round starts with the next "
                        "source); medians are reported, and ratios taken within each round")
    p.add_argument("--read-auth", action="store_true",
                   help="the service asks for a token on every read "
                        "(the clients send it; plain nginx asks for none)")
    p.add_argument("--held-grants", action="store_true",
                   help="the clients start with their grants (asked for before they fork): the load without "
                        "its start")
    p.add_argument("--compare", action="store_true", help="also Starlette FileResponse on uvicorn")
    p.add_argument("--epoch-workers", type=int, default=2)
    p.add_argument("--no-epoch", action="store_true", help="skip the loader epoch (only the range reads)")
    p.add_argument("--slowloris", type=int, default=0, metavar="N",
                   help="instead: normal clients beside N slowloris connections, the server's bounds off "
                        "then on")
    p.add_argument("--catalog-cost", type=int, default=0, metavar="N",
                   help="instead: what knowing whether a PostgreSQL catalog changed costs per request, by "
                        "notifications and by a query (N checks each; a PostgreSQL server is started on "
                        "loopback)")
    p.add_argument("--request-cost", type=int, default=0, metavar="N",
                   help="instead: the server CPU one request costs, N requests one after another as nginx "
                        "sends them: the service deciding a file for nginx to send (read auth), and a bare "
                        "aiohttp route")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--bare-aiohttp", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        starlette_main(args.role)
        return 0
    if args.bare_aiohttp:
        bare_aiohttp_main()
        return 0
    if args.catalog_cost:
        print("BENCH_JSON " + json.dumps({"catalog_cost": catalog_cost(args.catalog_cost)}, sort_keys=True))
        return 0
    shutil.rmtree(args.out, ignore_errors=True)
    root = os.path.join(args.out, "set")
    m = make_set(root, args.shards, args.clips)
    size = sum(s.bytes for s in m.splits["train"].shards)
    print(f"{args.shards} shards, {args.shards * args.clips} clips, {size / 1e6:.0f} MB; {args.clients} "
          f"clients in {args.procs} processes, {args.seconds:.0f} s per source", flush=True)
    cat = Catalog(os.path.join(args.out, "catalog.sqlite"))
    claim = cat.claim("be" * 32, source="bench", location=root, options={}, name="bench")
    splits, files, sha = describe_set(root)
    cat.finish(claim.record.id, claim.owner, splits=splits, files=files, manifest_sha256=sha,
               builder_version="bench")
    if args.slowloris:
        res = {"slowloris": slowloris(cat, m.splits["train"].shards[0].name, args.slowloris, args.seconds)}
        print("BENCH_JSON " + json.dumps(res, sort_keys=True))
        return 0

    token = os.path.join(args.out, "tokens")
    with open(token, "w") as f:
        f.write("bench-read-token\n")
    if args.request_cost:
        servers = {"the service deciding, nginx to send (--x-accel-redirect, read auth)":
                   [sys.executable, "-m", "service", "serve", "--port", "0", "--catalog", cat.path,
                    "--read-auth", "--token-file", token, *accel_flags(args.out)],
                   "a bare aiohttp route": [sys.executable, os.path.abspath(__file__), "--bare-aiohttp"]}
        res = request_cost(servers, f"/v1/datasets/bench/{m.splits['train'].shards[0].name}",
                           "bench-read-token", args.request_cost, args.rounds)
        print("BENCH_JSON " + json.dumps({"request_cost": res}, sort_keys=True))
        return 0
    if args.read_auth:  # the clients' requests carry it (shards.io.http_range reads fsspec's configuration)
        fsspec.config.conf["http"] = {"headers": {"Authorization": "Bearer bench-read-token"}}
    serve = [sys.executable, "-m", "service", "serve", "--port", "0", "--catalog", cat.path, "--workers",
             str(args.workers), *(["--read-auth", "--token-file", token] if args.read_auth else [])]
    sources = {LOCAL: None, SERVICE: serve}
    if not args.no_nginx:
        sources[NGINX_ROW] = None
        sources[ACCEL_ROW] = [*serve, *accel_flags(args.out)]
        sources[GRANT_ROW] = [*serve, *accel_flags(args.out),
                              *grant_flags(os.path.join(args.out, "grants"), GRANT_SECONDS)]
    if args.compare:
        sources["starlette FileResponse on uvicorn"] = [sys.executable, os.path.abspath(__file__), "--role",
                                                        root]
    rounds = []
    for r in range(args.rounds):
        # interleaved: each first in turn
        order = list(sources)[r % len(sources):] + list(sources)[:r % len(sources)]
        got = {}
        for label in order:
            got[label] = measure(label, sources[label], args, root, m)
            print(f"round {r + 1} {label}", got[label], flush=True)
        rounds.append(got)
    res = {"rounds": rounds, "workers": args.workers, "read_auth": args.read_auth,
           **{label: median_row([g[label] for g in rounds]) for label in sources}}
    ratios = {"service_vs_local_MB_s": (SERVICE, LOCAL, "MB_s")}
    if not args.no_nginx:
        ratios.update({"service_vs_nginx_MB_s": (SERVICE, NGINX_ROW, "MB_s"),
                       "service_vs_nginx_cpu_per_GB": (SERVICE, NGINX_ROW, "cpu_s_per_GB"),
                       "accel_vs_nginx_MB_s": (ACCEL_ROW, NGINX_ROW, "MB_s"),
                       "accel_vs_nginx_cpu_per_GB": (ACCEL_ROW, NGINX_ROW, "cpu_s_per_GB"),
                       "grants_vs_nginx_MB_s": (GRANT_ROW, NGINX_ROW, "MB_s"),
                       "grants_vs_nginx_cpu_per_GB": (GRANT_ROW, NGINX_ROW, "cpu_s_per_GB")})
    for key, (a, b, field) in ratios.items():  # per round (same load), then the median and range
        per_round = sorted(g[a][field] / g[b][field] for g in rounds)
        res[key], res[key + "_range"] = float(np.median(per_round)), [per_round[0], per_round[-1]]
    print(f"{'source':<42} {'MB/s':>7} {'req/s':>7} {'p50 ms':>7} {'server CPU s/GB':>16} {'load':>5}")
    for label in sources:
        row = res[label]
        print(f"{label:<42} {row['MB_s']:>7.0f} {row['req_s']:>7.0f} {row['p50_ms']:>7.1f} "
              f"{row.get('cpu_s_per_GB', float('nan')):>16.3f} {row['load_avg_1min']:>5.1f}")
    for label in (ACCEL_ROW, GRANT_ROW) if not args.no_nginx else ():
        print(f"  {label}: server CPU s/GB {res[label]['cpu_s_per_GB_process_0']:.3f} in the service, "
              f"{res[label]['cpu_s_per_GB_process_1']:.3f} in nginx")
    print(f"medians of {args.rounds} interleaved rounds, ratios taken within each round:")
    for key in ratios:
        print(f"  {key}: {res[key]:.2f} ({res[key + '_range'][0]:.2f}-{res[key + '_range'][1]:.2f})")
    if not args.no_nginx:
        print(f"goal for the service behind nginx checking its grants: throughput >= 0.95x nginx's "
              f"({res['grants_vs_nginx_MB_s']:.2f}), CPU per GB <= 1.1x "
              f"({res['grants_vs_nginx_cpu_per_GB']:.2f})"
              + (", read auth on" if args.read_auth else ""))
    if args.no_epoch:
        print("BENCH_JSON " + json.dumps(res, sort_keys=True))
        return 0

    proc, url = start(serve)
    try:
        res["epoch_local"] = epoch_wait(root, args.epoch_workers)
        res["epoch_http"] = epoch_wait(url + "/v1/datasets/bench", args.epoch_workers)
    finally:
        proc.terminate()
        proc.wait()
    res["epoch_http_vs_local"] = res["epoch_http"]["data_wait_s"] / res["epoch_local"]["data_wait_s"]
    print(f"one epoch ({res['epoch_local']['batches']} batches, {args.epoch_workers} workers): data wait "
          f"{res['epoch_local']['data_wait_s']:.2f} s local, {res['epoch_http']['data_wait_s']:.2f} s over "
          f"HTTP ({res['epoch_http_vs_local']:.2f}x)")
    print("BENCH_JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
