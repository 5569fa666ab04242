"""The API's views, one small coroutine per route; their paths and access levels are rows of
``service.api.routes.ROUTES``, enforced before a view runs (``service.api.middleware``)."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from shards.catalog import CatalogError
from shards.catalog.condition import shown

from .. import housekeeping
from ..builds import BadRequest
from ..files import content_type, presign
from ..roots import SourceRefused
from .keys import BODY_TIMEOUT, BUILDS, CATALOG, COUNTERS, METRICS, REDIRECT, SERVED, TABLES
from .responses import cache_control, send_span
from .sets import open_file, record


# --- reads -------------------------------------------------------------------------------------
async def index(request: web.Request) -> web.Response:
    """The API's base: where things are (no data, so no token), for a person who opens it: every
    route this server answers, with its access level."""
    listed = dict.fromkeys(request.app[SERVED].values())  # a GET's HEAD maps to the same row
    return web.json_response({"service": "shard-service", "viewer": "/",
                              "routes": [route.listed() for route in listed]})


async def health(request: web.Request) -> web.Response:
    states = {}
    for rec in request.app[CATALOG].list():
        states[rec.state] = states.get(rec.state, 0) + 1
    return web.json_response({"status": "ok", "datasets": states})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[COUNTERS].to_json())


async def metrics(request: web.Request) -> web.Response:
    """This server process's figures in Prometheus' text format (``service.api.metrics``)."""
    return await request.app[METRICS].exposition()


async def list_datasets(request: web.Request) -> web.Response:
    records = request.app[CATALOG].list()
    conditions = await asyncio.to_thread(lambda: [request.app[TABLES].condition(r, remote=False)
                                                  for r in records])
    return web.json_response({"datasets": [shown(r, c) for r, c in zip(records, conditions)]})


async def show_dataset(request: web.Request) -> web.Response:
    rec = record(request)
    return web.json_response(shown(rec, await asyncio.to_thread(request.app[TABLES].condition, rec)))


async def get_build(request: web.Request) -> web.Response:
    rec = request.app[CATALOG].get(request.match_info["id"])
    if rec is None:
        raise web.HTTPNotFound(text=f"no build {request.match_info['id']!r}")
    if rec.state == "building" and rec.request is not None and not rec.lease_alive():  # its builder is gone
        request.app[BUILDS].take_over_soon(rec)
    return web.json_response({"id": rec.id, "state": rec.state, "progress": rec.progress, "error": rec.error,
                              "location": rec.location, "attempts": rec.attempts,
                              "lease_alive": rec.lease_alive(), "record": rec.to_json()})


async def get_file(request: web.Request) -> web.StreamResponse:
    rec = record(request, ready=True)
    name = request.match_info["path"]
    rec, entry, fd = await open_file(request, rec, name)
    if fd is None and request.app[REDIRECT] and name.endswith(".tar"):
        url = await asyncio.to_thread(presign, f"{rec.location}/{name}", request.app[REDIRECT])
        if url:
            request.app[COUNTERS].add("redirects")
            return web.Response(status=307, headers={"Location": url, "ETag": entry.etag,
                                                     "Cache-Control": "no-store"})
    return send_span(request, rec, name, entry, 0, entry.size, entry.etag,
                     {"Content-Type": content_type(name)},
                     fd=fd, cache=cache_control(request, rec))


# --- writes ------------------------------------------------------------------------------------
async def post_build(request: web.Request) -> web.Response:
    try:
        async with asyncio.timeout(request.app[BODY_TIMEOUT]):
            body = await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within "
                                          f"{request.app[BODY_TIMEOUT]:g} s (--body-timeout)") from None
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
    rec = record(request)
    try:
        await asyncio.to_thread(request.app[CATALOG].tag, rec.id, request.match_info["tag"])
    except CatalogError as e:
        raise web.HTTPBadRequest(text=str(e)) from None
    return web.json_response(request.app[CATALOG].get(rec.id).to_json())


async def delete_tag(request: web.Request) -> web.Response:
    rec = record(request)
    tag = request.match_info["tag"]
    if not await asyncio.to_thread(request.app[CATALOG].untag, tag, rec.id):  # conditioned on the set
        raise web.HTTPNotFound(text=f"dataset {rec.id} has no tag {tag!r}")
    return web.json_response(request.app[CATALOG].get(rec.id).to_json())


async def delete_dataset(request: web.Request) -> web.Response:
    rec = record(request)
    purge = request.query.get("purge", "").lower() in ("1", "true", "yes")
    try:
        removed = await asyncio.to_thread(housekeeping.remove, request.app[CATALOG], rec, purge)
    except CatalogError as e:
        raise web.HTTPConflict(text=str(e)) from None
    return web.json_response({"id": rec.id, "state": "deleted", "purged": removed})
