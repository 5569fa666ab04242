"""The HTTP API on aiohttp's server: one small handler per route, all under ``/v1``.

    GET    /v1                              what is here: the routes below and the viewer (JSON, no token)
    GET    /v1/health                       liveness and counts
    GET    /v1/stats                        what the server carried (``service.stats``), all workers
    GET    /v1/datasets                     the catalog's live records (JSON)
    GET    /v1/datasets/{ref}               one record (ref: id, name, tag or unique id prefix)
    GET    /v1/datasets/{ref}/{file}        manifest.json, classes.txt, errors.jsonl, {split}/{shard}.tar
    HEAD   (the same)                       (conditional and range requests: service.ranges)
    DELETE /v1/datasets/{ref}[?purge=1]     forget a set; with purge, delete its files     [token]
    PUT    /v1/datasets/{ref}/tags/{tag}    point a tag at a set                           [token]
    DELETE /v1/datasets/{ref}/tags/{tag}    remove a tag                                   [token]
    POST   /v1/builds                       start an ingest (JSON body: src + options): 202 [token]
    GET    /v1/builds/{id}                  a build's state and progress
    GET    /, /sets/{ref}[/clips], /static/{name}, /v1/viewer/...   the dataset viewer (service.viewer,
                                            added by service.serve)

[token]: always needs a bearer token. With ``read_auth`` every other route needs one too, but
``/v1``, ``/v1/health`` and the viewer's pages, static files and ``/v1/viewer`` (none holds a
set's data).

Errors are JSON ``{"error": ..., "status": ...}``. Request paths must be plain: percent-escapes,
backslashes, dot segments and empty segments are refused (400) before routing, and a file is
looked up by exact name in the set's file table (``service.files``), never joined onto a path.
Local files go out with ``sendfile`` (zero copy, ranges included); remote sets stream through,
or, with ``redirect_seconds``, a shard of a set in an object store is answered with ``307`` to a
presigned URL of the object, valid that long, and the bytes never pass through the server.
Behind nginx, with ``x_accel_redirect``, nginx sends a local file's bytes and the server every
header and refusal (``service.accel``).

Every response says how it may be cached (RFC 9111), for HTTP caches in front of the server
(nginx's ``proxy_cache``, a site proxy, a CDN): a file named by its set's full id never changes
(``max-age`` of a year and ``immutable``; ``private`` when reads need a token); by name, tag or
id prefix it may move to another set (``no-cache``: a cache asks again, with ``If-None-Match``);
everything else (health, stats, listings, records, builds, errors, redirects) is ``no-store``.
A shard's ETag is its SHA-256 as last hashed (``service.files``): a local file changed since is
hashed again before it is served (``service.tables``), never served under its old ETag.

A set is served only while it is sound (``shards.catalog.condition``): one whose manifest changed
since it was registered answers ``409 Conflict`` naming what is there now and the remedy, and so
does one whose last verification found problems, unless the request asks for it as it is with
``Prefer: handling=lenient`` (RFC 7240), answered with ``Preference-Applied`` and never cached.
409, because the set's state conflicts with the request and a user can resolve it (rebuild,
repair and verify again) and ask again (RFC 9110 §15.5.10); not 503, which says the server is
overloaded or down and makes clients retry for minutes; not 410, which caches may keep. A set
forced out of its location by another build answers ``410 Gone``: its files are gone for good.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re

from aiohttp import web

from shards.catalog import Catalog, CatalogError, CatalogUnavailable, Record
from shards.catalog.condition import condition, shown
from shards.errors import DataFault
from shards.format.checks import BadManifest
from shards.http_range import Retry
from shards.reading import local_path, open_range

from . import accel, housekeeping
from .builds import BadRequest, Builds
from .files import Changed, Entry, Refused, content_type, open_local, presign
from .limits import OUT_OF_FILES, OutOfFiles
from .ranges import evaluate
from .records import RecordCache
from .roots import SourceRefused, SourceRoots
from .stats import Counters
from .tables import FileTables

log = logging.getLogger("service.app")
MAX_BODY = 64 * 1024
STREAM_CHUNK = 1 << 20
# A remote location that is down is not waited out while a client's request is held open: the
# answer is cut after a few seconds, and the client, which waits for its source as long as its
# own deadline says (shards.http_range), asks again.
UPSTREAM = Retry(deadline=5.0)
_PLAIN_PATH = re.compile(r"(/[A-Za-z0-9_\-~]+(\.[A-Za-z0-9_\-~]+)*)*/?")
CATALOG = web.AppKey("catalog", Catalog)
BUILDS = web.AppKey("builds", Builds)
TOKENS = web.AppKey("tokens", list)
READ_AUTH = web.AppKey("read_auth", bool)
TABLES = web.AppKey("tables", FileTables)
RECORDS = web.AppKey("records", RecordCache)
COUNTERS = web.AppKey("counters", Counters)
REDIRECT = web.AppKey("redirect_seconds", int)
ACCEL = web.AppKey("x_accel_redirect", str)
IMMUTABLE = "max-age=31536000, immutable"
REAP_SECONDS = 15  # how often builds whose builder died are looked for
FILES_LOG = web.AppKey("out_of_files", OutOfFiles)
BODY_TIMEOUT = web.AppKey("body_timeout", float)


def error(status: int, message: str, **headers) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status,
                             headers={**headers, "Cache-Control": "no-store"})


@web.middleware
async def json_errors(request: web.Request, handler):
    """Refuse unplain paths; answer every error as JSON; log unexpected ones and serve on."""
    request.app[COUNTERS].add("requests")
    raw = request.raw_path.split("?", 1)[0]
    if not _PLAIN_PATH.fullmatch(raw):
        return error(400, "request path must be plain: no escapes, dot segments, backslashes or empty segments")
    try:
        response = await handler(request)
        response.headers.setdefault("Cache-Control", "no-store")
        return response
    except CatalogUnavailable as e:
        log.warning("%s %s: %s", request.method, request.path, e)
        return error(503, "the catalog cannot be reached; try again shortly", **{"Retry-After": "1"})
    except Refused as e:
        return error(e.status, str(e))
    except (BadManifest, DataFault) as e:  # the set's bytes refuse a reader: its state, not the request, is wrong
        log.warning("%s %s: %s", request.method, request.path, e)
        return error(409, f"{e} (shard-service verify marks the set; shards verify names every damaged sample)")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error(e.status, e.text if e.text and not e.text.startswith(str(e.status)) else e.reason,
                     **{k: v for k, v in e.headers.items() if k in ("Allow", "WWW-Authenticate")})
    except OSError as e:
        if e.errno not in OUT_OF_FILES:
            log.exception("%s %s", request.method, request.path)
            return error(500, "internal error (see the server log)")
        request.app[FILES_LOG].note("requests")
        return error(503, "the server is out of open files; try again", **{"Retry-After": "1"})
    except Exception:
        log.exception("%s %s", request.method, request.path)
        return error(500, "internal error (see the server log)")


def _authorised(request: web.Request) -> None:
    """Raise 401 without a bearer token, 403 with a wrong one (compared in constant time)."""
    tokens = request.app[TOKENS]
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise web.HTTPUnauthorized(text="this needs Authorization: Bearer TOKEN",
                                   headers={"WWW-Authenticate": 'Bearer realm="shard-service"'})
    ok = False
    for token in tokens:  # every token compared, whatever matched before
        ok |= hmac.compare_digest(given.strip().encode(), token.encode())
    if not ok:
        raise web.HTTPForbidden(text="wrong token" if tokens else "writes are disabled: the server has no --token-file")


def _reader(request: web.Request) -> None:
    if request.app[READ_AUTH]:
        _authorised(request)


LENIENT = "handling=lenient"  # RFC 7240's preference: a damaged set's files as they are


def lenient(request: web.Request) -> bool:
    """Whether the request asks for a damaged set's files as they are (``Prefer: handling=lenient``)."""
    return any(p.strip().lower() == LENIENT for value in request.headers.getall("Prefer", [])
               for p in value.split(","))


def _record(request: web.Request, ready: bool = False, damaged: bool = False) -> Record:
    """The request's set; a ready one (a file read) from the record cache, refused when damaged
    unless ``damaged`` (the viewer, which shows the state) or the request asks leniently."""
    ref = request.match_info["ref"]
    rec = (request.app[RECORDS] if ready else request.app[CATALOG]).resolve(ref)
    if rec is None:
        gone = request.app[CATALOG].replaced(ref)
        if gone is not None:
            raise Refused(410, condition(gone).sentence(gone))
        raise web.HTTPNotFound(text=f"no dataset {ref!r}")
    if ready and rec.state != "ready":
        raise web.HTTPConflict(text=f"dataset {rec.id} is {rec.state}, not ready: nothing of it is served")
    if ready and rec.verify_problems and not (damaged or lenient(request)):
        raise Refused(409, f"{condition(rec, check_files=False).sentence(rec)}; to read it as it is, send "
                           f"Prefer: {LENIENT}")
    return rec


# --- reads -------------------------------------------------------------------------------------
async def index(request: web.Request) -> web.Response:
    """The API's base: where things are (no data, so no token), for a person who opens it."""
    return web.json_response({"service": "shard-service", "viewer": "/", "datasets": "/v1/datasets",
                              "dataset": "/v1/datasets/{ref}", "health": "/v1/health", "stats": "/v1/stats",
                              "builds": "/v1/builds"})


async def health(request: web.Request) -> web.Response:
    states = {}
    for rec in request.app[CATALOG].list():
        states[rec.state] = states.get(rec.state, 0) + 1
    return web.json_response({"status": "ok", "datasets": states})


async def stats(request: web.Request) -> web.Response:
    _reader(request)  # the server's pid and traffic: not for anyone who can reach the port
    return web.json_response(request.app[COUNTERS].to_json())


async def list_datasets(request: web.Request) -> web.Response:
    _reader(request)
    records = request.app[CATALOG].list()
    conditions = await asyncio.to_thread(lambda: [request.app[TABLES].condition(r, remote=False) for r in records])
    return web.json_response({"datasets": [shown(r, c) for r, c in zip(records, conditions)]})


async def show_dataset(request: web.Request) -> web.Response:
    _reader(request)
    rec = _record(request)
    return web.json_response(shown(rec, await asyncio.to_thread(request.app[TABLES].condition, rec)))


async def get_build(request: web.Request) -> web.Response:
    _reader(request)
    rec = request.app[CATALOG].get(request.match_info["id"])
    if rec is None:
        raise web.HTTPNotFound(text=f"no build {request.match_info['id']!r}")
    if rec.state == "building" and rec.request is not None and not rec.lease_alive():  # its builder is gone
        request.app[BUILDS].take_over_soon(rec)
    return web.json_response({"id": rec.id, "state": rec.state, "progress": rec.progress, "error": rec.error,
                              "location": rec.location, "attempts": rec.attempts,
                              "lease_alive": rec.lease_alive(), "record": rec.to_json()})


async def _entry(request: web.Request, rec: Record, name: str) -> Entry:
    entry = (await request.app[TABLES].table(rec)).get(name)
    if entry is None:
        raise web.HTTPNotFound(text=f"dataset {rec.id} has no file {name!r}")
    return entry


async def open_file(request: web.Request, rec: Record, name: str,
                    damaged: bool = False) -> tuple[Record, Entry, int | None]:
    """The file's entry and, for a local set, a descriptor of it, the file hashed again first if it
    changed since it was last hashed (``service.tables``); the record as it then stands (``damaged``:
    as ``_record``'s)."""
    entry = await _entry(request, rec, name)
    root = local_path(rec.location)
    if root is None:
        return rec, entry, None
    try:
        return rec, entry, open_local(root, name, entry)  # a few system calls: no thread hop
    except Changed:
        await request.app[TABLES].changed(rec, name)  # the whole set changed (409), or this file hashed again
    rec = _record(request, ready=True, damaged=damaged)  # as recorded after hashing
    entry = await _entry(request, rec, name)
    try:
        return rec, entry, open_local(root, name, entry)
    except Changed:
        raise Refused(503, f"{name} is changing while it is served; try again later") from None


def cache_control(request: web.Request, rec: Record) -> str:
    """How caches may keep a file of ``rec`` asked for by this request's reference."""
    if rec.verify_problems:
        return "no-store"  # a damaged set, read as it is: nothing of it is kept as the set
    if request.match_info["ref"] != rec.id:
        return "no-cache"  # a name or tag may point at another set tomorrow
    return f"{'private' if request.app[READ_AUTH] else 'public'}, {IMMUTABLE}"


async def get_file(request: web.Request) -> web.StreamResponse:
    _reader(request)
    rec = _record(request, ready=True)
    name = request.match_info["path"]
    rec, entry, fd = await open_file(request, rec, name)
    if fd is None and request.app[REDIRECT] and name.endswith(".tar"):
        url = await asyncio.to_thread(presign, f"{rec.location}/{name}", request.app[REDIRECT])
        if url:
            request.app[COUNTERS].add("redirects")
            return web.Response(status=307, headers={"Location": url, "ETag": entry.etag, "Cache-Control": "no-store"})
    return send_span(request, rec, name, entry, 0, entry.size, entry.etag, {"Content-Type": content_type(name)},
                     fd=fd, cache=cache_control(request, rec))


def send_span(request: web.Request, rec: Record, name: str, entry: Entry, offset: int, size: int, etag: str,
              extra: dict, *, fd: int | None, cache: str) -> web.StreamResponse:
    """Bytes [offset, offset + size) of a set's file as one representation with its own strong
    ``etag`` (a whole file, or one frame inside a shard), conditionals and ranges applied;
    ``extra``: headers of a 200 or 206 answer (its Content-Type); ``fd``: the file, opened by
    ``open_file`` (None: a remote set, streamed); ``cache``: its Cache-Control."""
    answer = evaluate(request.method, size, etag, request.headers)
    headers = {"ETag": etag, "Accept-Ranges": "bytes", "Cache-Control": cache}
    if rec.verify_problems and lenient(request):
        headers.update({"Preference-Applied": LENIENT, "Vary": "Prefer"})
    if answer.status not in (200, 206):
        if fd is not None:
            os.close(fd)
        if answer.status == 304:
            return web.Response(status=304, headers=headers)
        if answer.status == 416:
            headers["Content-Range"] = f"bytes */{size}"
        return error(answer.status, answer.reason or "precondition failed", **headers)
    if answer.status == 206:
        headers["Content-Range"] = f"bytes {answer.start}-{answer.end - 1}/{size}"
    headers.update(extra)
    if request.method == "GET" and name.endswith(".tar"):
        request.app[COUNTERS].add("shard_requests")
        request.app[COUNTERS].add("shard_bytes", answer.length)
    prefix = request.app[ACCEL]
    if prefix and fd is not None and offset == 0 and size == entry.size and request.method == "GET" \
            and accel.asked(request.headers) and accel.nginx_agrees(request.headers):
        os.close(fd)  # checked; nginx opens it again and sends it (service.accel)
        request.app[COUNTERS].add("accel_redirects")
        return web.Response(headers={**headers, **accel.redirect(prefix, local_path(rec.location), name)})
    if fd is not None:
        response = _Sendfile(fd, offset + answer.start, answer.length, status=answer.status, headers=headers)
    else:
        response = _Streamed(f"{rec.location}/{name}", entry, offset + answer.start, offset + answer.end,
                             status=answer.status, headers=headers)
    response.content_length = answer.length
    return response


class _Sendfile(web.StreamResponse):
    """Bytes [offset, offset + count) of a descriptor, sent by the kernel (``sendfile``)."""

    def __init__(self, fd: int, offset: int, count: int, **kw):
        super().__init__(**kw)
        self._span = (fd, offset, count)

    async def prepare(self, request):
        fd, offset, count = self._span
        try:
            writer = await super().prepare(request)
            if request.method != "HEAD" and count:
                with open(fd, "rb", closefd=False) as f:
                    await asyncio.get_running_loop().sendfile(request.transport, f, offset, count)
            await super().write_eof()
            return writer
        finally:
            os.close(fd)


class _Streamed(web.StreamResponse):
    """Bytes [start, end) of a remote file, read in a thread and written as they come."""

    def __init__(self, url: str, entry: Entry, start: int, end: int, **kw):
        super().__init__(**kw)
        self._source = (url, entry, start, end)

    async def prepare(self, request):
        url, entry, start, end = self._source
        writer = await super().prepare(request)
        if request.method != "HEAD" and end > start:
            src = await asyncio.to_thread(open_range, url, start, end, size=entry.size, sha256=entry.sha256,
                                          retry=UPSTREAM)
            try:
                while chunk := await asyncio.to_thread(src.read, STREAM_CHUNK):
                    await self.write(chunk)
            finally:
                src.close()
        await self.write_eof()
        return writer


# --- writes ------------------------------------------------------------------------------------
async def post_build(request: web.Request) -> web.Response:
    _authorised(request)
    try:
        async with asyncio.timeout(request.app[BODY_TIMEOUT]):
            body = await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {request.app[BODY_TIMEOUT]:g} s "
                                          "(--body-timeout)") from None
    try:
        body = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise web.HTTPBadRequest(text=f"the body is not JSON: {e}") from None
    try:
        status, answer = await request.app[BUILDS].request(body)
    except (BadRequest, CatalogError) as e:
        raise web.HTTPBadRequest(text=str(e)) from None
    except SourceRefused as e:
        raise web.HTTPForbidden(text=str(e)) from None
    return web.json_response(answer, status=status, headers={"Location": answer["status_url"]})


async def put_tag(request: web.Request) -> web.Response:
    _authorised(request)
    rec = _record(request)
    try:
        await asyncio.to_thread(request.app[CATALOG].tag, rec.id, request.match_info["tag"])
    except CatalogError as e:
        raise web.HTTPBadRequest(text=str(e)) from None
    return web.json_response(request.app[CATALOG].get(rec.id).to_json())


async def delete_tag(request: web.Request) -> web.Response:
    _authorised(request)
    rec = _record(request)
    tag = request.match_info["tag"]
    if not await asyncio.to_thread(request.app[CATALOG].untag, tag, rec.id):  # conditioned on the set
        raise web.HTTPNotFound(text=f"dataset {rec.id} has no tag {tag!r}")
    return web.json_response(request.app[CATALOG].get(rec.id).to_json())


async def delete_dataset(request: web.Request) -> web.Response:
    _authorised(request)
    rec = _record(request)
    purge = request.query.get("purge", "").lower() in ("1", "true", "yes")
    try:
        removed = await asyncio.to_thread(housekeeping.remove, request.app[CATALOG], rec, purge)
    except CatalogError as e:
        raise web.HTTPConflict(text=str(e)) from None
    return web.json_response({"id": rec.id, "state": "deleted", "purged": removed})


async def _reap_periodically(app: web.Application):
    async def reap():
        """Builds asked for over HTTP whose builder died are taken over (``service.builds``); any
        other build whose builder died is marked failed."""
        try:
            await app[BUILDS].take_over()
            for dataset in await asyncio.to_thread(app[CATALOG].reap):
                log.warning("build %s: its builder died; marked failed", dataset)
        except CatalogUnavailable as e:
            log.warning("builds not checked: %s", e)

    async def loop():
        while True:
            await asyncio.sleep(REAP_SECONDS)
            await reap()
    await reap()  # at startup, before the first request: builds that died with a previous server
    task = asyncio.create_task(loop())
    yield
    task.cancel()


async def _close_records(app: web.Application) -> None:
    app[RECORDS].close()


async def _stop_builds(app: web.Application) -> None:
    await app[BUILDS].stop()


def make_app(catalog: Catalog, *, tokens: list[str] = (), read_auth: bool = False, data_root: str,
             ray_address: str | None = None, source_roots: SourceRoots = SourceRoots([]),
             max_build_workers: int = 1, max_builds: int = 1, body_timeout: float = 60.0,
             out_of_files: OutOfFiles | None = None, counters: Counters | None = None,
             redirect_seconds: int = 0, x_accel_redirect: str = "") -> web.Application:
    app = web.Application(middlewares=[json_errors], client_max_size=MAX_BODY)
    app[CATALOG], app[TOKENS], app[READ_AUTH] = catalog, list(tokens), read_auth
    app[COUNTERS], app[REDIRECT], app[ACCEL] = counters or Counters(), redirect_seconds, x_accel_redirect
    app[TABLES] = FileTables(catalog, app[COUNTERS])
    app[RECORDS] = RecordCache(catalog)
    app[BODY_TIMEOUT], app[FILES_LOG] = body_timeout, out_of_files or OutOfFiles()
    app[BUILDS] = Builds(catalog, data_root, ray_address, roots=source_roots, max_workers=max_build_workers,
                         max_running=max_builds)
    app.cleanup_ctx.append(_reap_periodically)
    app.on_shutdown.append(_stop_builds)
    app.on_cleanup.append(_close_records)
    app.router.add_get("/v1", index)
    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/datasets", list_datasets)
    app.router.add_get("/v1/datasets/{ref}", show_dataset)
    app.router.add_delete("/v1/datasets/{ref}", delete_dataset)
    app.router.add_put("/v1/datasets/{ref}/tags/{tag}", put_tag)
    app.router.add_delete("/v1/datasets/{ref}/tags/{tag}", delete_tag)
    app.router.add_get("/v1/datasets/{ref}/{path:.+}", get_file)  # HEAD too
    app.router.add_post("/v1/builds", post_build)
    app.router.add_get("/v1/builds/{id}", get_build)
    return app
