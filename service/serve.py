"""Serve the catalog's shard sets over HTTP (see docs/service.md for the API).

Prints ``serving http://HOST:PORT/v1`` once listening (``--port 0`` picks a free port).
SIGTERM or SIGINT stops it, and the builds it runs (each in a process of its own, recorded failed:
``stopped``); builds of a server killed outright stop by themselves (``abandoned``).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from aiohttp import web

from shards.catalog import Catalog, default_path

from .app import make_app
from .limits import Admission, OutOfFiles, connections_allowed, raise_open_files
from .roots import SourceRoots
from .viewer import add_routes as add_viewer

log = logging.getLogger("service.serve")
MAX_CONNECTIONS = 8192


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--catalog", default=default_path(), help="catalog file ($SHARD_SERVICE_CATALOG)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    p.add_argument("--token-file", help="file of bearer tokens allowed to write, one per line (without it, "
                                        "writes are refused)")
    p.add_argument("--read-auth", action="store_true", help="reads need a token too (all but /v1/health)")
    p.add_argument("--data-root", help="where builds asked for over HTTP are written (path or fsspec URL; "
                                       "default: a 'sets' directory beside the catalog)")
    p.add_argument("--ray-address", help="run builds on this Ray cluster (default: an embedded local Ray)")
    p.add_argument("--source-root", action="append", default=[], metavar="DIR_OR_URL",
                   help="builds asked for over HTTP may read only sources under this local directory (symbolic "
                        "links resolved) or URL prefix (e.g. s3://bucket/videos); repeat for several. Without "
                        "any, POST /v1/builds is refused (403)")
    p.add_argument("--max-build-workers", type=int, default=os.cpu_count(),
                   help="the most decode tasks a build request may ask for (its 'workers')")
    p.add_argument("--max-builds", type=int, default=1,
                   help="build processes run at once; further builds wait their turn (each build process starts "
                        "its own embedded Ray, or joins --ray-address)")
    p.add_argument("--header-timeout", type=float, default=20.0,
                   help="seconds a connection has to send a complete request head, from its opening or the end of "
                        "the previous response (also how long an idle connection is kept)")
    p.add_argument("--body-timeout", type=float, default=60.0, help="seconds a request body has to arrive (408)")
    p.add_argument("--max-connections", type=int, default=None,
                   help=f"connections at once; more get 503 (default: {MAX_CONNECTIONS}, lowered to fit the "
                        "open-files limit; 0: no limit)")
    p.add_argument("--max-connections-per-client", type=int, default=256,
                   help="connections at once from one client address; more get 503 (0: no limit, e.g. behind a "
                        "reverse proxy, where every client has the proxy's address)")
    p.add_argument("--access-log", action="store_true", help="log every request")


def read_tokens(path: str | None) -> list[str]:
    if not path:
        return []
    with open(path) as f:
        tokens = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    if not tokens:
        raise SystemExit(f"{path}: no tokens in it")
    return tokens


async def serve(args: argparse.Namespace) -> None:
    for flag in ("max_builds", "max_build_workers"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    try:
        roots = SourceRoots(args.source_root)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    open_files = raise_open_files()
    max_connections = connections_allowed(open_files, MAX_CONNECTIONS) if args.max_connections is None \
        else args.max_connections
    if args.max_connections and args.max_connections > connections_allowed(open_files, args.max_connections):
        log.warning("--max-connections %d: more than %d open files allow; expect failed accepts under load",
                    args.max_connections, open_files)
    out_of_files = OutOfFiles()
    out_of_files.install(asyncio.get_running_loop())
    catalog = Catalog(args.catalog)  # the app's reaper, at startup, marks builds that died with a previous server failed
    data_root = args.data_root or os.path.join(os.path.dirname(os.path.abspath(args.catalog)), "sets")
    app = make_app(catalog, tokens=read_tokens(args.token_file), read_auth=args.read_auth, data_root=data_root,
                   ray_address=args.ray_address, source_roots=roots, max_build_workers=args.max_build_workers,
                   max_builds=args.max_builds, body_timeout=args.body_timeout, out_of_files=out_of_files)
    add_viewer(app)  # the pages and their routes, on the same port
    runner = web.AppRunner(app, access_log=logging.getLogger("service.access") if args.access_log else None,
                           handle_signals=False, keepalive_timeout=args.header_timeout)
    await runner.setup()
    admission = Admission(max_connections, args.max_connections_per_client)
    server = await asyncio.get_running_loop().create_server(admission.protocol(runner.server), args.host, args.port,
                                                            backlog=1024, reuse_address=True)
    host, port = server.sockets[0].getsockname()[:2]
    log.info("open files %d; connections at most %s, %s per client; request heads within %g s, bodies within %g s",
             open_files, max_connections or "unlimited", args.max_connections_per_client or "unlimited",
             args.header_timeout, args.body_timeout)
    print(f"serving http://{host}:{port}/v1 (catalog {args.catalog})", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    server.close()
    await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0
