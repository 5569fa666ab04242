"""The request's set and its files, as the views (the API's and the viewer's) are given them.

A set is served only while it is sound (``shards.catalog.condition``): one whose manifest changed
since it was registered answers ``409 Conflict`` naming what is there now and the remedy, and so
does one whose last verification found problems, unless the request asks for it as it is with
``Prefer: handling=lenient`` (RFC 7240), answered with ``Preference-Applied`` and never cached.
409, because the set's state conflicts with the request and a user can resolve it (rebuild,
repair and verify again) and ask again (RFC 9110 §15.5.10); not 503, which says the server is
overloaded or down and makes clients retry for minutes; not 410, which caches may keep. A set
forced out of its location by another build answers ``410 Gone``: its files are gone for good.
A file is looked up by exact name in the set's file table (``service.files``), never joined onto
a path.
"""
from __future__ import annotations

from aiohttp import web

from shards.catalog import Record
from shards.catalog.condition import condition
from shards.read.reading import local_path

from ..files import Changed, Entry, Refused, open_local
from .keys import CATALOG, RECORDS, TABLES
from .responses import LENIENT, lenient


def record(request: web.Request, ready: bool = False, damaged: bool = False) -> Record:
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


async def _entry(request: web.Request, rec: Record, name: str) -> Entry:
    entry = (await request.app[TABLES].table(rec)).get(name)
    if entry is None:
        raise web.HTTPNotFound(text=f"dataset {rec.id} has no file {name!r}")
    return entry


async def open_file(request: web.Request, rec: Record, name: str,
                    damaged: bool = False) -> tuple[Record, Entry, int | None]:
    """The file's entry and, for a local set, a descriptor of it, the file hashed again first if it
    changed since it was last hashed (``service.tables``); the record as it then stands (``damaged``:
    as ``record``'s)."""
    entry = await _entry(request, rec, name)
    root = local_path(rec.location)
    if root is None:
        return rec, entry, None
    try:
        return rec, entry, open_local(root, name, entry)  # a few system calls: no thread hop
    except Changed:
        await request.app[TABLES].changed(rec, name)  # the whole set changed (409), or this file hashed again
    rec = record(request, ready=True, damaged=damaged)  # as recorded after hashing
    entry = await _entry(request, rec, name)
    try:
        return rec, entry, open_local(root, name, entry)
    except Changed:
        raise Refused(503, f"{name} is changing while it is served; try again later") from None
