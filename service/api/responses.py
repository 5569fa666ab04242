"""How a set's bytes go out, and how every answer may be cached.

Local files go out with ``sendfile`` (zero copy, ranges included); remote sets stream through, or,
with ``redirect_seconds``, a shard of a set in an object store is answered with ``307`` to a
presigned URL of the object, valid that long, and the bytes never pass through the server (the
file view, ``service.api.views``). Behind nginx, with ``front``, nginx sends a local file's bytes
and the server every header and refusal (``service.accel``), or, with grants, a shard is answered
with ``307`` to a URL nginx checks and serves by itself until it expires (``service.grants``).
Each counts the body bytes it sent (``service.api.metrics.Span``), for the access log and the
metrics.

Every response says how it may be cached (RFC 9111), for HTTP caches in front of the server
(nginx's ``proxy_cache``, a site proxy, a CDN): a file named by its set's full id never changes
(``max-age`` of a year and ``immutable``; ``private`` when reads need a token); by name, tag or
id prefix it may move to another set (``no-cache``: a cache asks again, with ``If-None-Match``);
a grant is ``private`` for its lifetime, less a second; everything else (health, stats,
listings, records, builds, errors, redirects to object stores) is ``no-store``.
A shard's ETag is its SHA-256 as last hashed (``service.files``): a local file changed since is
hashed again before it is served (``service.tables``), never served under its old ETag.
"""
from __future__ import annotations

import asyncio
import os

from aiohttp import web

from shards.catalog import Record
from shards.io.http_range import Retry
from shards.read.reading import local_path, open_range

from .. import accel
from ..files import Entry
from ..ranges import evaluate
from .keys import ACCEL, COUNTERS, READ_AUTH
from .metrics import Span

STREAM_CHUNK = 1 << 20
# A remote location that is down is not waited out while a client's request is held open: the
# answer is cut after a few seconds, and the client, which waits for its source as long as its
# own deadline says (shards.io.http_range), asks again.
UPSTREAM = Retry(deadline=5.0)
IMMUTABLE = "max-age=31536000, immutable"
LENIENT = "handling=lenient"  # RFC 7240's preference: a damaged set's files as they are


def error(status: int, message: str, **headers) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status,
                             headers={**headers, "Cache-Control": "no-store"})


def lenient(request: web.Request) -> bool:
    """Whether the request asks for a damaged set's files as they are (``Prefer: handling=lenient``)."""
    return any(p.strip().lower() == LENIENT for value in request.headers.getall("Prefer", [])
               for p in value.split(","))


def cache_control(request: web.Request, rec: Record) -> str:
    """How caches may keep a file of ``rec`` asked for by this request's reference."""
    if rec.verify_problems:
        return "no-store"  # a damaged set, read as it is: nothing of it is kept as the set
    if request.match_info["ref"] != rec.id:
        return "no-cache"  # a name or tag may point at another set tomorrow
    return f"{'private' if request.app[READ_AUTH] else 'public'}, {IMMUTABLE}"


def send_span(request: web.Request, rec: Record, name: str, entry: Entry, offset: int, size: int, etag: str,
              extra: dict, *, fd: int | None, cache: str) -> web.StreamResponse:
    """Bytes [offset, offset + size) of a set's file as one representation with its own strong
    ``etag`` (a whole file, or one frame inside a shard), conditionals and ranges applied;
    ``extra``: headers of a 200 or 206 answer (its Content-Type); ``fd``: the file, opened by
    ``service.api.sets.open_file`` (None: a remote set, streamed); ``cache``: its Cache-Control."""
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
    front = request.app[ACCEL]
    secret = front.sends(request.headers) if front is not None and fd is not None and offset == 0 \
        and size == entry.size and request.method == "GET" and accel.nginx_agrees(request.headers) else None
    if secret and front.grants is not None and front.grants.covers(rec.id, name):
        os.close(fd)  # checked; granted for a while, nginx checks the grant and sends it (service.grants)
        front.grants.link(rec.id, local_path(rec.location))
        url, max_age = front.grants.location(rec.id, name, request.headers.get("Authorization", ""), secret)
        request.app[COUNTERS].add("grants")
        return web.Response(status=307, headers={"Location": url, "ETag": etag,
                                                 "Cache-Control": f"private, max-age={max_age}"})
    if request.method == "GET" and name.endswith(".tar"):
        request.app[COUNTERS].add("shard_requests")
        request.app[COUNTERS].add("shard_bytes", answer.length)
    if secret:
        os.close(fd)  # checked; nginx opens it again and sends it (service.accel)
        request.app[COUNTERS].add("accel_redirects")
        return web.Response(headers={**headers, **front.redirect(local_path(rec.location), name)})
    if fd is not None:
        response = _Sendfile(fd, offset + answer.start, answer.length, status=answer.status, headers=headers)
    else:
        response = _Streamed(f"{rec.location}/{name}", entry, offset + answer.start, offset + answer.end,
                            status=answer.status, headers=headers)
    response.content_length = answer.length
    return response


class _Sendfile(Span):
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
                    f.seek(offset)
                    try:
                        await asyncio.get_running_loop().sendfile(request.transport, f, offset, count)
                    finally:  # the file's position is past what was sent, even when the client went away
                        self.sent = f.tell() - offset
            await super().write_eof()
            return writer
        finally:
            os.close(fd)


class _Streamed(Span):
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
                    self.sent += len(chunk)
            finally:
                src.close()
        await self.write_eof()
        return writer
