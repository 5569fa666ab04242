"""Serve the catalog's shard sets over HTTP (see docs/service.md for the API).

Once listening (``--port 0`` picks a free port) it prints where to look, both answering 200:

    serving http://HOST:PORT/ : the dataset viewer
            http://HOST:PORT/v1 : the API (a set's URL: http://HOST:PORT/v1/datasets/NAME); catalog PATH

SIGTERM or SIGINT stops it, and the builds it runs (each in a process of its own, recorded failed:
``stopped``); builds of a server killed outright stop by themselves (``abandoned``). Stopped by
SIGTERM (a service manager), it exits 0; by Ctrl-C, with one line and status 130.

``--workers N`` (N > 1) forks N server processes that share the port through ``SO_REUSEPORT``
(the kernel spreads connections over them) and the one catalog file (SQLite, as any number of
processes may; each notices the others' commits, ``service.records``). The parent holds the
port, starts the workers, forwards SIGTERM and SIGINT to them, and stops them all if one dies.
Each worker runs the builds asked of it (up to ``--max-builds`` each) and applies the connection
limits to its own connections; the catalog's claim still makes one build of one id.

Before anything starts (no catalog opened, no build taken over) it refuses in one line: a catalog
file that does not exist unless ``--create`` (a typo would serve an empty catalog), a token file it
cannot read or that holds no token, ``--read-auth`` without one, and an address it cannot listen
on (a busy port: exit 1, the command is sound and works once the port is free; a ``--host`` not of
this machine: 2). A request aiohttp cannot parse is answered 400 by aiohttp and is one access-log
line, never a traceback (``_Malformed``).

Why one file of about 360 lines: it is the entry point. The flags, their one-line checks and the
process model that reads them (the socket, the forked workers, the signals) all take the parsed
namespace, which goes no further: below it ``service.api.make_app`` takes typed arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import re
import signal
import socket

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from shards.base.commands import int_in_range, number_in_range, positive_int
from shards.base.errors import CommandError, Interrupted, NotFound, UsageError
from shards.catalog import Catalog, default_path
from shards.catalog.backends import is_url, shown

from .accel import SECRET, SECRET_HEADER, Front
from .admin import refuse_missing
from .api.app import make_app
from .api.keys import METRICS
from .api.metrics import traffic
from .api.routes import ROUTES
from .grants import GRANT_SECONDS, Grants
from .limits import Admission, OutOfFiles, connections_allowed, raise_open_files
from .records import STALE_SECONDS
from .roots import SourceRoots
from .stats import Counters
from .viewer import ROUTES as VIEWER_ROUTES
from .viewer import add_routes as add_viewer

log = logging.getLogger("service.serve")
MAX_CONNECTIONS = 8192


class _Malformed(logging.Filter):
    """aiohttp's report of a request it could not parse (a header line over its 8,190 bytes, a request
    line or chunk size that is not HTTP): aiohttp answers it 400 and the access log, when on, has its
    one line; the traceback aiohttp logs with it would let any client, with no token, grow the log by
    kilobytes a request. Anything else it logs (a bug) keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HttpProcessingError))


HTTP_LOG = logging.getLogger("service.http")  # aiohttp's protocol handler's log (its own: aiohttp.server)
HTTP_LOG.addFilter(_Malformed())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--catalog", default=default_path(),
                   help="catalog: a SQLite file, or a PostgreSQL database (postgresql://USER@HOST:PORT/DB) "
                        "that replicas of the service share ($SHARD_SERVICE_CATALOG); a file that does not "
                        "exist is refused unless --create")
    p.add_argument("--catalog-staleness", type=number_in_range(float, 0), default=STALE_SECONDS,
                   metavar="SECONDS",
                   help="while the catalog cannot be reached (a PostgreSQL outage), a set this replica has "
                        "looked up is served from its last known record for at most this long after the "
                        "replica saw a commit it could not check (the longest a change made just before an "
                        "outage goes unseen; 0: none is served, every read 503 until the catalog answers); "
                        "records no commit touched serve on whatever the outage's length (service.records)")
    p.add_argument("--create", action="store_true",
                   help="start an empty catalog file (and its directory) if --catalog names none, e.g. for "
                        "builds asked for over HTTP; without it a typo would serve an empty catalog")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_in_range(0, 65535), default=8765, help="port (0: any free one)")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="server processes sharing the port (SO_REUSEPORT)")
    p.add_argument("--redirect", type=int, default=0, metavar="SECONDS",
                   help="answer GETs of shards of sets in an object store with 307 to a presigned URL valid "
                        "this long, so their bytes bypass the server (default 0: stream them through)")
    p.add_argument("--x-accel-redirect", default="", metavar="PREFIX",
                   help="behind nginx: answer GETs of local sets' files that nginx can send (requests "
                        "carrying X-Sendfile-Type: X-Accel-Redirect) with every header decided here and "
                        "X-Accel-Redirect: PREFIX/<the file's path>, for nginx to send the bytes from its "
                        "internal location PREFIX/ (docs/runbooks/service.md); refusals, 304s and anything "
                        "nginx would answer differently are answered here as without it; needs "
                        "--x-accel-secret-file")
    p.add_argument("--x-accel-secret-file", metavar="FILE",
                   help=f"with --x-accel-redirect: the secrets (one a line, any accepted) nginx sends as "
                        f"{SECRET_HEADER} "
                        "(docker/nginx-replicas.conf); a request without one gets the bytes from the server, "
                        "never a server path")
    p.add_argument("--grant-links", metavar="DIR",
                   help="with --x-accel-redirect: grant shards for nginx to check and send itself "
                        "(service.grants); DIR holds links to the sets, one directory for nginx and every "
                        "replica")
    p.add_argument("--grant-seconds", type=int_in_range(2, 86400), default=GRANT_SECONDS,
                   help="a grant's lifetime: the longest a client refused since still reads (default "
                        "%(default)s)")
    p.add_argument("--token-file", help="file of bearer tokens allowed to write, one per line (without it, "
                                        "writes are refused)")
    p.add_argument("--read-auth", action="store_true",
                   help="reads need a token too (all but the open routes, which hold no set's data: "
                        + ", ".join(r.pattern for r in (*ROUTES, *VIEWER_ROUTES) if r.access == "open")
                        + "); needs --token-file")
    p.add_argument("--data-root", help="where builds asked for over HTTP are written (path or fsspec URL; "
                                       "default: a 'sets' directory beside a catalog file; needed with a "
                                       "PostgreSQL catalog: storage every replica reaches)")
    p.add_argument("--ray-address", help="run builds on this Ray cluster (default: an embedded local Ray)")
    p.add_argument("--source-root", action="append", default=[], metavar="DIR_OR_URL",
                   help="builds asked for over HTTP may read only sources under this local directory "
                        "(symbolic links resolved) or URL prefix (e.g. s3://bucket/videos); repeat for "
                        "several. Without any, POST /v1/builds is refused (403)")
    p.add_argument("--max-build-workers", type=positive_int, default=os.cpu_count(),
                   help="the most decode tasks a build request may ask for (its 'workers')")
    p.add_argument("--max-builds", type=positive_int, default=1,
                   help="build processes run at once; further builds wait their turn (each build process "
                        "starts its own embedded Ray, or joins --ray-address)")
    p.add_argument("--header-timeout", type=float, default=20.0,
                   help="seconds a connection has to send a complete request head, from its opening or the "
                        "end of the previous response (also how long an idle connection is kept)")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body has to arrive (408)")
    p.add_argument("--max-connections", type=int, default=None,
                   help=f"connections at once; more get 503 (default: {MAX_CONNECTIONS}, lowered to fit the "
                        "open-files limit; 0: no limit)")
    p.add_argument("--max-connections-per-client", type=int, default=256,
                   help="connections at once from one client address; more get 503 (0: no limit, e.g. behind "
                        "a reverse proxy, where every client has the proxy's address)")
    p.add_argument("--access-log", action="store_true", help="log every request")


def read_tokens(path: str | None, flag: str = "--token-file") -> list[str]:
    """The tokens of ``--token-file`` (or another ``flag``'s file of secrets; none without one); a
    file that cannot be read, or holds none, refused."""
    if not path:
        return []
    try:
        with open(path) as f:
            tokens = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    except FileNotFoundError:
        raise NotFound(f"{flag} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise UsageError(f"{flag} {path}: cannot be read as text: {reason}") from None
    if not tokens:
        raise UsageError(f"{flag} {path}: no tokens in it (one a line; a line starting with # is a comment)")
    return tokens


def front(args: argparse.Namespace) -> Front | None:
    """The nginx of ``--x-accel-redirect``, trusted by ``--x-accel-secret-file``'s secrets (None without
    it)."""
    if not args.x_accel_redirect:
        return None
    grants = Grants(args.grant_links, args.grant_seconds) if args.grant_links else None
    return Front(args.x_accel_redirect, tuple(read_tokens(args.x_accel_secret_file, "--x-accel-secret-file")),
                 grants)


async def serve(args: argparse.Namespace, counters: Counters, sock: socket.socket,
                ready_fd: int | None = None) -> int:
    """One server process on ``sock`` (bound), until SIGTERM or SIGINT (returned); ``ready_fd``: a pipe to
    write a byte to once listening (a worker), else the ``serving`` line is printed."""
    roots = SourceRoots(args.source_root)  # checked by check_flags
    open_files = raise_open_files()
    max_connections = connections_allowed(open_files, MAX_CONNECTIONS) if args.max_connections is None \
        else args.max_connections
    if args.max_connections and args.max_connections > connections_allowed(open_files, args.max_connections):
        log.warning("--max-connections %d: more than %d open files allow; expect failed accepts under load",
                    args.max_connections, open_files)
    out_of_files = OutOfFiles()
    out_of_files.install(asyncio.get_running_loop())
    admission = Admission(max_connections, args.max_connections_per_client)
    # the app's reaper, at startup, takes over or fails builds that died with a server
    catalog = Catalog(args.catalog)
    data_root = args.data_root or ("" if is_url(args.catalog) else
                                   os.path.join(os.path.dirname(os.path.abspath(args.catalog)), "sets"))
    app = make_app(catalog, tokens=read_tokens(args.token_file), read_auth=args.read_auth,
                   data_root=data_root,
                   ray_address=args.ray_address, source_roots=roots, max_build_workers=args.max_build_workers,
                   max_builds=args.max_builds, body_timeout=args.body_timeout, out_of_files=out_of_files,
                   counters=counters, redirect_seconds=args.redirect, front=front(args), admission=admission,
                   catalog_staleness=args.catalog_staleness)
    add_viewer(app)  # the pages and their routes, on the same port
    runner = web.AppRunner(app, access_log=logging.getLogger("service.access"),
                           access_log_class=traffic(app[METRICS], args.access_log),
                           handle_signals=False, keepalive_timeout=args.header_timeout, logger=HTTP_LOG)
    await runner.setup()
    server = await asyncio.get_running_loop().create_server(admission.protocol(runner.server), sock=sock,
                                                            backlog=1024)
    host, port = server.sockets[0].getsockname()[:2]
    log.info("open files %d; connections at most %s, %s per client; request heads within %g s, bodies within "
             "%g s",
             open_files, max_connections or "unlimited", args.max_connections_per_client or "unlimited",
             args.header_timeout, args.body_timeout)
    stop, signals = asyncio.Event(), []
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, lambda sig=sig: (signals.append(sig), stop.set()))
    if ready_fd is None:
        print(start_lines(host, port, args.catalog), flush=True)
    else:
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    await stop.wait()
    log.info("stopping")
    server.close()
    await runner.cleanup()
    # The stop is under way, and further signals say nothing new: they are ignored from here on (in
    # every thread; the loop's handlers, and its wakeup fd, removed first). Otherwise one landing while
    # asyncio.run closes the loop (the group's Ctrl-C and the parent's SIGTERM both reach a worker)
    # finds the wakeup fd closed ("Exception ignored when trying to write to the signal wakeup fd:
    # OSError: [Errno 9]"), and one after it meets the default handlers the loop puts back.
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    return signals[0]


def start_lines(host: str, port: int, catalog: str, workers: int = 1) -> str:
    """What ``serve`` prints once listening: the viewer's URL, then the API's base (and the
    catalog, a URL without its password)."""
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    processes = f", {workers} worker processes" if workers > 1 else ""
    return (f"serving {base}/ : the dataset viewer\n"
            f"        {base}/v1 : the API (a set's URL: {base}/v1/datasets/NAME); catalog "
            f"{shown(catalog)}{processes}")


def _stopped(signum: int) -> int:
    """The status of a server stopped by ``signum``: 0 for SIGTERM, Ctrl-C's one line for SIGINT."""
    if signum == signal.SIGINT:
        raise Interrupted("interrupted: the server has stopped, and the builds it was running are recorded "
                          "'stopped' in the catalog")
    return 0


def _socket(host: str, port: int, shared: bool) -> socket.socket:
    """A socket bound (not listening) to host:port, with SO_REUSEPORT when ``shared`` (by workers)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _bind(host: str, port: int, shared: bool) -> socket.socket:
    """``_socket``, or the one line saying why not (before anything else has started). A port shared by
    workers is first bound without SO_REUSEPORT, so that one another server's workers share is found
    busy rather than joined."""
    try:
        sock = _socket(host, port, shared=False)
        if shared:
            port = sock.getsockname()[1]
            sock.close()
            sock = _socket(host, port, shared=True)
        return sock
    except OSError as e:
        where = f"{f'[{host}]' if ':' in host else host}:{port}"
        if e.errno == errno.EADDRINUSE:
            raise CommandError(f"{where}: address already in use: another process listens there (stop it, or "
                               "give another --port; --port 0 takes a free one)") from None
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"--host {host}: not an address of this machine ({e.strerror})") from None
        raise CommandError(f"{where}: cannot listen there: {e.strerror}") from None


def _fork_workers(args: argparse.Namespace) -> int:
    held = _bind(args.host, args.port, shared=True)  # the port the workers share, held by the parent
    port = held.getsockname()[1]
    Catalog(args.catalog).close()  # its migrations run once, here, before any worker opens it
    counters = Counters(args.workers)
    ready_r, ready_w = os.pipe()
    pids = []
    for row in range(args.workers):
        pid = os.fork()
        if pid == 0:  # a worker
            held.close()
            os.close(ready_r)
            counters.in_worker(row)
            code = 0
            try:
                asyncio.run(serve(args, counters, _socket(args.host, port, shared=True), ready_w))
            except BaseException:
                log.exception("worker %d", row)
                code = 1
            os._exit(code)
        pids.append(pid)
    os.close(ready_w)
    stopping = []

    def stop(signum, _frame):
        stopping.append(signum)
        for p in pids:
            os.kill(p, signal.SIGTERM)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    started = 0
    while started < args.workers and (got := os.read(ready_r, args.workers)):
        started += len(got)
    os.close(ready_r)
    if started == args.workers:
        print(start_lines(args.host, port, args.catalog, args.workers), flush=True)
    code = 0
    while pids:
        pid, status = os.wait()
        pids.remove(pid)
        if status and not stopping:
            log.error("worker %d exited (status %d); stopping the others", pid, status)
            code = 1
            stop(signal.SIGTERM, None)
    held.close()
    if started < args.workers:
        return 1
    return code or (_stopped(stopping[0]) if stopping else 0)


def check_flags(args: argparse.Namespace) -> None:
    """What ``serve`` refuses before anything starts: a catalog file that does not exist (unless
    ``--create``), tokens that cannot be read, ``--read-auth`` without them, bad source roots, and the
    flags of a replica behind nginx."""
    if not args.create:
        refuse_missing(args.catalog, "`ingest build --catalog FILE` creates one, and --create an empty one")
    if args.read_auth and not args.token_file:
        raise UsageError("--read-auth needs --token-file: without tokens no one could read anything")
    read_tokens(args.token_file)
    try:
        SourceRoots(args.source_root)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.x_accel_redirect and not re.fullmatch(r"(/[A-Za-z0-9_.~-]+)+", args.x_accel_redirect):
        raise UsageError(f"--x-accel-redirect {args.x_accel_redirect}: give a plain URI path such as /_accel "
                         "(nginx's internal location for the files: docker/nginx-replicas.conf)")
    if bool(args.x_accel_redirect) != bool(args.x_accel_secret_file):
        raise UsageError("--x-accel-redirect and --x-accel-secret-file go together: nginx is trusted with "
                         "server paths only by the secret it sends (docker/nginx-replicas.conf)")
    if args.grant_links and not (args.x_accel_redirect and os.path.isdir(args.grant_links)
                                 and os.access(args.grant_links, os.W_OK | os.X_OK)):
        raise UsageError(f"--grant-links {args.grant_links}: a directory this user can write, with "
                         "--x-accel-redirect (grants are checked by the nginx in front)")
    for secret in read_tokens(args.x_accel_secret_file, "--x-accel-secret-file"):
        if not SECRET.fullmatch(secret):
            raise UsageError("--x-accel-secret-file: each secret 16 or more letters, digits, - or _ (e.g. "
                             "`openssl rand -hex 32`), as nginx's config holds it")
    if is_url(args.catalog) and args.source_root and not args.data_root:
        raise UsageError("--data-root: needed with a PostgreSQL catalog and --source-root (where builds "
                         "asked for over HTTP are written: storage every replica reaches)")


def run(args: argparse.Namespace) -> int:
    check_flags(args)
    if args.workers == 1:
        return _stopped(asyncio.run(serve(args, Counters(), _bind(args.host, args.port, shared=False))))
    return _fork_workers(args)
