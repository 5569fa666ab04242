"""The HTTP API on aiohttp's server: one small handler per route, all under ``/v1``.

    GET    /v1/health                       liveness and counts
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

Errors are JSON ``{"error": ..., "status": ...}``. Request paths must be plain: percent-escapes,
backslashes, dot segments and empty segments are refused (400) before routing, and a file is
looked up by exact name in the set's file table (``service.files``), never joined onto a path.
Local files go out with ``sendfile`` (zero copy, ranges included); remote sets stream through.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re

from aiohttp import web

from shards.catalog import Catalog, CatalogError, Record
from shards.reading import local_path, open_range

from . import housekeeping
from .builds import BadRequest, Builds
from .files import Entry, Refused, content_type, file_table, open_local
from .limits import OUT_OF_FILES, OutOfFiles
from .ranges import evaluate
from .records import RecordCache
from .roots import SourceRefused, SourceRoots

log = logging.getLogger("service.app")
MAX_BODY = 64 * 1024
STREAM_CHUNK = 1 << 20
_PLAIN_PATH = re.compile(r"(/[A-Za-z0-9_\-~]+(\.[A-Za-z0-9_\-~]+)*)*/?")
CATALOG = web.AppKey("catalog", Catalog)
BUILDS = web.AppKey("builds", Builds)
TOKENS = web.AppKey("tokens", list)
READ_AUTH = web.AppKey("read_auth", bool)
TABLES = web.AppKey("tables", dict)
RECORDS = web.AppKey("records", RecordCache)
FILES_LOG = web.AppKey("out_of_files", OutOfFiles)
BODY_TIMEOUT = web.AppKey("body_timeout", float)


def error(status: int, message: str, **headers) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler):
    """Refuse unplain paths; answer every error as JSON; log unexpected ones and serve on."""
    raw = request.raw_path.split("?", 1)[0]
    if not _PLAIN_PATH.fullmatch(raw):
        return error(400, "request path must be plain: no escapes, dot segments, backslashes or empty segments")
    try:
        return await handler(request)
    except Refused as e:
        return error(e.status, str(e))
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


def _record(request: web.Request, ready: bool = False) -> Record:
    """The request's set; a ready one (a file read) from the record cache."""
    rec = (request.app[RECORDS] if ready else request.app[CATALOG]).resolve(request.match_info["ref"])
    if rec is None:
        raise web.HTTPNotFound(text=f"no dataset {request.match_info['ref']!r}")
    if ready and rec.state != "ready":
        raise web.HTTPConflict(text=f"dataset {rec.id} is {rec.state}, not ready: nothing of it is served")
    return rec


# --- reads -------------------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    states = {}
    for rec in request.app[CATALOG].list():
        states[rec.state] = states.get(rec.state, 0) + 1
    return web.json_response({"status": "ok", "datasets": states})


async def list_datasets(request: web.Request) -> web.Response:
    _reader(request)
    return web.json_response({"datasets": [r.to_json() for r in request.app[CATALOG].list()]})


async def show_dataset(request: web.Request) -> web.Response:
    _reader(request)
    return web.json_response(_record(request).to_json())


async def get_build(request: web.Request) -> web.Response:
    _reader(request)
    rec = request.app[CATALOG].get(request.match_info["id"])
    if rec is None:
        raise web.HTTPNotFound(text=f"no build {request.match_info['id']!r}")
    return web.json_response({"id": rec.id, "state": rec.state, "progress": rec.progress, "error": rec.error,
                              "location": rec.location, "attempts": rec.attempts,
                              "lease_alive": rec.lease_alive(), "record": rec.to_json()})


async def _entry(request: web.Request, rec: Record, name: str) -> Entry:
    tables = request.app[TABLES]
    key = (rec.id, rec.manifest_sha256)
    if key not in tables:
        if len(tables) > 64:
            tables.clear()
        tables[key] = await asyncio.to_thread(file_table, rec.location, rec.files, rec.manifest_sha256)
    entry = tables[key].get(name)
    if entry is None:
        raise web.HTTPNotFound(text=f"dataset {rec.id} has no file {name!r}")
    return entry


async def get_file(request: web.Request) -> web.StreamResponse:
    _reader(request)
    rec = _record(request, ready=True)
    name = request.match_info["path"]
    entry = await _entry(request, rec, name)
    return send_span(request, rec, name, entry, 0, entry.size, entry.etag, {"Content-Type": content_type(name)})


def send_span(request: web.Request, rec: Record, name: str, entry: Entry, offset: int, size: int, etag: str,
              extra: dict) -> web.StreamResponse:
    """Bytes [offset, offset + size) of a set's file as one representation with its own strong
    ``etag`` (a whole file, or one frame inside a shard), conditionals and ranges applied;
    ``extra``: headers of a 200 or 206 answer (its Content-Type)."""
    answer = evaluate(request.method, size, etag, request.headers)
    headers = {"ETag": etag, "Accept-Ranges": "bytes"}
    if answer.status in (400, 412, 416):
        if answer.status == 416:
            headers["Content-Range"] = f"bytes */{size}"
        return error(answer.status, answer.reason or "precondition failed", **headers)
    if answer.status == 304:
        return web.Response(status=304, headers=headers)
    if answer.status == 206:
        headers["Content-Range"] = f"bytes {answer.start}-{answer.end - 1}/{size}"
    headers.update(extra)
    root = local_path(rec.location)
    if root is not None:
        fd = open_local(root, name, entry)  # a few system calls on a local directory: no thread hop
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
            src = await asyncio.to_thread(open_range, url, start, end, size=entry.size, sha256=entry.sha256)
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
        for dataset in await asyncio.to_thread(app[CATALOG].reap):
            log.warning("build %s: its builder died; marked failed", dataset)

    async def loop():
        while True:
            await asyncio.sleep(15)
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
             out_of_files: OutOfFiles | None = None) -> web.Application:
    app = web.Application(middlewares=[json_errors], client_max_size=MAX_BODY)
    app[CATALOG], app[TOKENS], app[READ_AUTH], app[TABLES] = catalog, list(tokens), read_auth, {}
    app[RECORDS] = RecordCache(catalog)
    app[BODY_TIMEOUT], app[FILES_LOG] = body_timeout, out_of_files or OutOfFiles()
    app[BUILDS] = Builds(catalog, data_root, ray_address, roots=source_roots, max_workers=max_build_workers,
                         max_running=max_builds)
    app.cleanup_ctx.append(_reap_periodically)
    app.on_shutdown.append(_stop_builds)
    app.on_cleanup.append(_close_records)
    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/datasets", list_datasets)
    app.router.add_get("/v1/datasets/{ref}", show_dataset)
    app.router.add_delete("/v1/datasets/{ref}", delete_dataset)
    app.router.add_put("/v1/datasets/{ref}/tags/{tag}", put_tag)
    app.router.add_delete("/v1/datasets/{ref}/tags/{tag}", delete_tag)
    app.router.add_get("/v1/datasets/{ref}/{path:.+}", get_file)  # HEAD too
    app.router.add_post("/v1/builds", post_build)
    app.router.add_get("/v1/builds/{id}", get_build)
    return app
