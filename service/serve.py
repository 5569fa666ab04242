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
from .viewer import add_routes as add_viewer

log = logging.getLogger("service.serve")


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
    p.add_argument("--max-builds", type=int, default=1,
                   help="build processes run at once; further builds wait their turn (each build process starts "
                        "its own embedded Ray, or joins --ray-address)")
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
    if args.max_builds < 1:
        raise SystemExit(f"--max-builds {args.max_builds}: must be at least 1")
    catalog = Catalog(args.catalog)  # the app's reaper, at startup, marks builds that died with a previous server failed
    data_root = args.data_root or os.path.join(os.path.dirname(os.path.abspath(args.catalog)), "sets")
    app = make_app(catalog, tokens=read_tokens(args.token_file), read_auth=args.read_auth, data_root=data_root,
                   ray_address=args.ray_address, max_builds=args.max_builds)
    add_viewer(app)  # the pages and their routes, on the same port
    runner = web.AppRunner(app, access_log=logging.getLogger("service.access") if args.access_log else None,
                           handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024, reuse_address=True)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"serving http://{host}:{port}/v1 (catalog {args.catalog})", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0
