"""The dataset viewer: three pages on the API's port, their static files, and the JSON and frame
routes they read: the pages ``/``, ``/sets/{ref}`` and ``/sets/{ref}/clips``, ``/static/{name}``
(package data, ``service/static/``) and ``/v1/viewer/...``, each a row of ``ROUTES`` below with its
access level (``service.api.routes``); what each answers is docs/service.md's.

The pages are static shells holding no data. Their one script fetches the JSON routes with the
bearer token the user typed (kept in the tab's sessionStorage, sent as an Authorization header,
never in a URL or cookie) and builds the page with ``textContent``, so names from user data
(sets, tags, classes, paths, decoder messages) are never parsed as HTML; every viewer answer
carries a Content-Security-Policy that allows scripts and styles from this origin only (no inline
script), ``nosniff`` and ``Referrer-Policy: no-referrer``. With ``--read-auth`` the JSON and
frame routes need the token; the shells do not, and show nothing but the login form without it.

Paging and filtering happen here, on a ``shards.read.clipindex.ClipIndex`` built once per set (the
manifest parsed in a thread): the browser never downloads the manifest. A frame is served like
any file of a set (``service.api.responses.send_span``: conditionals, ranges, sendfile for local
sets) as the byte range of its tar member; the frame's place in the shard is read once per clip
(one read of the clip's bytes) and kept. Its strong ETag is the shard's SHA-256 and the frame's
offset. Asked for by dataset id, which names content, it is cached for a year as immutable;
by a name or tag, which can move, it is revalidated each time.

Every page shows a set's state as the catalog's commands do (``shards.catalog.condition``),
with why and the remedy: a set whose manifest changed is shown but not indexed; a damaged set
(its last verification found problems) is shown and browsed, in its state's colour, never
green, and its frames are not cached.

A set built with ``--motion`` has a motion field beside each frame; the pages show it coloured as
optical-flow figures are (``shards.format.motioncolour``, the colouring ``shards preview`` draws with):
the clip is read once, its fields coloured at one scale for the whole clip (given with the clip's
JSON) and kept, each served as a PNG of its frame's size. A picture made here, not stored bytes:
its ETag names the clip's bytes and the colouring, and it is revalidated each time. The colour
wheel is ``/static/motion-legend.png``.

Why one file of about 360 lines: the viewer is one sub-application, its routes (``ROUTES``),
views and their small JSON helpers beside the caches of its one ``Viewer``; the server takes only
its ``ROUTES`` and ``add_routes``.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib.resources
import io
import json
from collections import OrderedDict

from aiohttp import web
from PIL import Image

from shards.catalog import Record
from shards.catalog.condition import shown
from shards.format import motioncolour
from shards.format.manifest import Manifest
from shards.io import storage
from shards.read.clipindex import ClipIndex, read_clip
from shards.tools.stats import split_stats

from . import states
from .api.keys import READ_AUTH, TABLES
from .api.responses import cache_control, send_span
from .api.routes import Route, add
from .api.sets import open_file, record
from .files import checked_manifest
from .ranges import evaluate

PAGE_SIZE, MAX_PAGE_SIZE = 48, 200  # clips per page: default and largest
MAX_LEDGER_ROWS = 1000  # error ledger rows sent to the set page (the total is always given)
PROBE_CLIPS = 8  # clips read per split for frames per clip and frame sizes
SETS_KEPT, CLIPS_KEPT = 4, 8192  # indexed sets and clips' frame positions kept in memory
MOTION_KEPT = 256  # clips whose coloured motion fields are kept (a few kB each)
COLOURING = "mb1"  # the colouring's version, in the ETags of coloured fields: a new one is a new picture
SECURITY = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' "
                               "blob:; connect-src 'self'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
                ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}
SHELL = "viewer.html"  # every page: the script draws the one the path names


class _Static:
    """The files of ``service/static`` (read once), each with its content type and strong ETag."""

    def __init__(self):
        folder = importlib.resources.files("service").joinpath("static")
        files = {item.name: item.read_bytes() for item in folder.iterdir()}
        # drawn by the motion fields' colouring
        files["motion-legend.png"] = motioncolour.png(motioncolour.legend())
        self.files = {}
        for name, data in files.items():
            suffix = name[name.rfind("."):]
            if suffix in STATIC_TYPES:
                self.files[name] = (data, STATIC_TYPES[suffix], f'"{hashlib.sha256(data).hexdigest()}"')

    def response(self, request: web.Request, name: str) -> web.Response:
        if name not in self.files:
            raise web.HTTPNotFound(text=f"no static file {name!r}")
        data, ctype, etag = self.files[name]
        headers = {"ETag": etag, "Cache-Control": "no-cache", **SECURITY}
        if evaluate("HEAD", len(data), etag, request.headers).status == 304:  # If-None-Match only
            return web.Response(status=304, headers=headers)
        return web.Response(body=data, headers={**headers, "Content-Type": ctype})


class Viewer:
    """Per-server state: the static files, and per set its clip index, overview and clips' frame positions."""

    def __init__(self):
        self.static = _Static()
        self._sets: OrderedDict[tuple, asyncio.Future] = OrderedDict()
        self._frames: OrderedDict[tuple, list[tuple[int, int]]] = OrderedDict()
        self._motion: OrderedDict[tuple, asyncio.Future] = OrderedDict()  # (coloured fields, scale) per clip

    async def indexed(self, rec: Record) -> dict:
        """{"manifest", "index", "overview"} of a ready set, built once (in a thread) and shared
        (the probe route adds "probe")."""
        return await _kept(self._sets, (rec.id, rec.manifest_sha256), SETS_KEPT, _index, rec)

    async def frames(self, rec: Record, manifest: Manifest, clip) -> list[tuple[int, int]]:
        """(offset in the shard, size) of each frame of ``clip``: one read of the clip, then kept."""
        key = (rec.id, rec.manifest_sha256, clip.split, clip.n)
        if key not in self._frames:
            sample = await asyncio.to_thread(read_clip, manifest, clip)
            self._frames[key] = [(clip.offset + offset, size) for offset, size in sample.spans]
            while len(self._frames) > CLIPS_KEPT:
                self._frames.popitem(last=False)
        return self._frames[key]

    async def motion(self, rec: Record, manifest: Manifest, clip) -> tuple[list[bytes], float]:
        """The clip's motion fields coloured (PNG bytes, frame order) and their scale (pixels per
        frame at full colour): one read of the clip however many ask at once, then kept."""
        return await _kept(self._motion, (rec.id, rec.manifest_sha256, clip.split, clip.n), MOTION_KEPT,
                           _coloured, manifest, clip)


async def _kept(kept: OrderedDict, key: tuple, limit: int, work, *args):
    """``work(*args)``, in a thread, once for every caller of ``key`` at the same time; its result
    kept with the ``limit`` most recently used; a failure is not kept (asked again, tried again)."""
    if key not in kept:
        kept[key] = asyncio.ensure_future(asyncio.to_thread(work, *args))
        while len(kept) > limit:
            kept.popitem(last=False)
    kept.move_to_end(key)
    future = kept[key]
    try:
        return await asyncio.shield(future)
    except Exception:
        kept.pop(key, None)
        raise


def _coloured(manifest: Manifest, clip) -> tuple[list[bytes], float]:
    sample = read_clip(manifest, clip)
    size = Image.open(io.BytesIO(sample.frames[0])).size
    pictures, scale = motioncolour.render(sample.fields, size)
    return [motioncolour.png(p) for p in pictures], scale


VIEWER = web.AppKey("viewer", Viewer)


def _index(rec: Record) -> dict:
    manifest = checked_manifest(rec)
    index = ClipIndex(manifest)
    splits = {name: {"clips": len(part), "bytes": manifest.splits[name].num_bytes, "shards": len(part.shards),
                     "failed": manifest.splits[name].num_failed,
                     "histogram": part.histogram(len(index.classes)).tolist()}
              for name, part in index.splits.items()}
    return {"manifest": manifest, "index": index,
            "overview": {"classes": index.classes, "frames_per_clip": index.frames_per_clip(),
                         "splits": splits, "errors": _ledger(rec)}}


def _ledger(rec: Record) -> dict:
    """The first rows of the set's errors.jsonl (path, split, reason, decoder message), their total and
    how many of them are warnings (``ingest build``'s, beside its failures)."""
    if "errors.jsonl" not in rec.files:
        return {"total": 0, "rows": []}
    lines = [json.loads(line) for line in storage.read_bytes(storage.join(rec.location, "errors.jsonl"))
             .decode().splitlines() if line.strip()]
    warnings = sum("warning" in r for r in lines)  # videos used with a caveat, or listed and not found
    return {"total": len(lines), "warnings": warnings,
            "rows": [{**{k: str(r.get(k, "")) for k in ("path", "split", "ffmpeg")}, "reason": _reason(r)}
                     for r in lines[:MAX_LEDGER_ROWS]]}


def _reason(line: dict) -> str:
    """A ledger line's reason, a warning's marked as one (with its code)."""
    reason = str(line.get("reason", ""))
    return f"warning ({line['warning']}): {reason}" if "warning" in line else reason


def _json(data: dict) -> web.Response:
    return web.json_response(data, headers={**SECURITY, "Cache-Control": "no-store"})


def _int(request: web.Request, name: str, default: int | None, low: int,
         high: int | None = None) -> int | None:
    text = request.query.get(name)
    if text is None or text == "":
        return default
    if not text.isdigit() or int(text) < low or (high is not None and int(text) > high):
        raise web.HTTPBadRequest(text=f"{name}={text[:20]!r}: give a whole number from {low}"
                                      + (f" to {high}" if high is not None else ""))
    return int(text)


async def _ready(request: web.Request) -> tuple[Record, dict]:
    """The request's ready set and its index; a damaged one too: the viewer shows its state."""
    rec = record(request, ready=True, damaged=True)
    return rec, await request.app[VIEWER].indexed(rec)


def _split(data: dict, name: str):
    try:
        return data["index"].split(name)
    except KeyError as e:
        raise web.HTTPNotFound(text=e.args[0]) from None


def _clip(part, n: str):
    try:
        return part.clip(int(n))
    except (ValueError, IndexError):
        raise web.HTTPNotFound(text=f"split {part.name} has {len(part)} clips; there is no clip "
                                    f"{n!r}") from None


def _clip_json(index: ClipIndex, clip) -> dict:
    label = clip.label
    return {"n": clip.n, "key": clip.key, "label": label,
            "class": index.classes[label] if 0 <= label < len(index.classes) else None,
            "shard": clip.shard.name, "offset": clip.offset, "length": clip.length}


# --- pages and static files --------------------------------------------------------------------
async def page(request: web.Request) -> web.Response:
    return request.app[VIEWER].static.response(request, SHELL)


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name.endswith(".html"):
        raise web.HTTPNotFound(text=f"no static file {name!r}")  # the pages' shell has its own routes
    return request.app[VIEWER].static.response(request, name)


# --- JSON and frames ---------------------------------------------------------------------------
async def settings(request: web.Request) -> web.Response:
    """Whether reads need a token (the pages ask before anything else, so none fails before the
    login) and the states' badges (``service.states``: no data of any set)."""
    return _json({"read_auth": request.app[READ_AUTH], "states": states.table()})


async def overview(request: web.Request) -> web.Response:
    rec = record(request)
    found = await asyncio.to_thread(request.app[TABLES].condition, rec)
    if found.state not in ("ready", "damaged"):  # nothing of it is the registered set to show
        return _json({"record": shown(rec, found), "classes": [], "splits": {}, "errors": None})
    data = await request.app[VIEWER].indexed(rec)
    return _json({"record": shown(rec, found), **data["overview"]})


async def probe(request: web.Request) -> web.Response:
    rec, data = await _ready(request)
    if "probe" not in data:  # kept with the set's index
        manifest = data["manifest"]
        stats = await asyncio.to_thread(lambda: {name: split_stats(manifest, name, PROBE_CLIPS)
                                                 for name in manifest.splits})
        keys = ("probed_clips", "frames_per_clip", "frame_sizes", "bytes_per_frame", "shard_bytes")
        data["probe"] = {"splits": {name: {k: s[k] for k in keys} for name, s in stats.items()}}
    return _json(data["probe"])


async def clips(request: web.Request) -> web.Response:
    rec, data = await _ready(request)
    index = data["index"]
    part = _split(data, request.query.get("split") or next(iter(index.splits), ""))
    label = _int(request, "class", None, 0, len(index.classes) - 1)
    per_page = _int(request, "per_page", PAGE_SIZE, 1, MAX_PAGE_SIZE)
    page = _int(request, "page", 0, 0)
    chosen = part.matching(None if label is None else [label])
    shown = [_clip_json(index, part.clip(int(n))) for n in chosen[page * per_page:(page + 1) * per_page]]
    frames = index.frames_per_clip()
    if frames is None and shown:  # a manifest that does not say: count the first clip's
        frames = len(await request.app[VIEWER].frames(rec, data["manifest"], part.clip(shown[0]["n"])))
    return _json({"id": rec.id, "split": part.name, "splits": list(index.splits), "class": label,
                  "classes": index.classes, "page": page, "per_page": per_page, "total": int(len(chosen)),
                  "pages": -(-len(chosen) // per_page), "frames": frames,
                  "motion": _motion_kind(data["manifest"]),
                  "clips": shown})


async def clip_detail(request: web.Request) -> web.Response:
    rec, data = await _ready(request)
    clip = _clip(_split(data, request.match_info["split"]), request.match_info["n"])
    sample = await asyncio.to_thread(read_clip, data["manifest"], clip)
    spans = sample.spans
    kind = _motion_kind(data["manifest"])
    scale = (await request.app[VIEWER].motion(rec, data["manifest"], clip))[1] if kind else None
    return _json({"id": rec.id, "split": clip.split, **_clip_json(data["index"], clip),
                  "frames": len(spans), "frame_bytes": [size for _, size in spans], "meta": sample.meta(),
                  "motion": kind, "motion_scale": scale})


async def frame(request: web.Request) -> web.StreamResponse:
    rec, data = await _ready(request)
    clip = _clip(_split(data, request.match_info["split"]), request.match_info["n"])
    spans = await request.app[VIEWER].frames(rec, data["manifest"], clip)
    t = request.match_info["t"]
    if not t.isdigit() or int(t) >= len(spans):
        raise web.HTTPNotFound(text=f"clip {clip.n} of {clip.split} has {len(spans)} frames; there is no "
                                    f"frame {t!r}")
    offset, size = spans[int(t)]
    rec, entry, fd = await open_file(request, rec, clip.shard.name, damaged=True)
    etag = f'"{entry.etag.strip(chr(34))}.{offset}"'  # the shard's bytes as last hashed, and where in it
    response = send_span(request, rec, clip.shard.name, entry, offset, size, etag,
                         {"Content-Type": "image/jpeg"},
                         fd=fd, cache=cache_control(request, rec))
    response.headers.update(SECURITY)
    return response


async def motion(request: web.Request) -> web.Response:
    rec, data = await _ready(request)
    kind = _motion_kind(data["manifest"])
    if kind is None:
        raise web.HTTPNotFound(text=f"dataset {rec.id} has no motion fields (ingest build --motion stores "
                                    f"them)")
    clip = _clip(_split(data, request.match_info["split"]), request.match_info["n"])
    pictures, _ = await request.app[VIEWER].motion(rec, data["manifest"], clip)
    t = request.match_info["t"]
    if not t.isdigit() or int(t) >= len(pictures):
        raise web.HTTPNotFound(text=f"clip {clip.n} of {clip.split} has {len(pictures)} motion fields; there "
                                    f"is no field {t!r}")
    body = pictures[int(t)]
    headers = {"ETag": f'"{clip.shard.sha256}.{clip.offset}.{kind}.{t}.{COLOURING}"',
               "Cache-Control": "no-store" if rec.verify_problems  # a damaged set: nothing of it kept
               else ("private, " if request.app[READ_AUTH] else "") + "no-cache", **SECURITY}
    if evaluate("HEAD", len(body), headers["ETag"], request.headers).status == 304:  # If-None-Match
        return web.Response(status=304, headers=headers)
    return web.Response(body=body, headers={**headers, "Content-Type": "image/png"})


def _motion_kind(manifest: Manifest) -> str | None:
    return None if manifest.motion == "none" else manifest.motion


ROUTES = (
    Route("GET", "/", page, "open"),  # the pages: shells holding no data
    Route("GET", "/sets/{ref}", page, "open"),
    Route("GET", "/sets/{ref}/clips", page, "open"),
    Route("GET", "/static/{name}", static, "open"),
    Route("GET", "/v1/viewer", settings, "open"),
    Route("GET", "/v1/viewer/{ref}", overview, "read"),
    Route("GET", "/v1/viewer/{ref}/probe", probe, "read"),
    Route("GET", "/v1/viewer/{ref}/clips", clips, "read"),
    Route("GET", "/v1/viewer/{ref}/clips/{split}/{n}", clip_detail, "read"),
    Route("GET", "/v1/viewer/{ref}/frames/{split}/{n}/{t}", frame, "read"),
    Route("GET", "/v1/viewer/{ref}/motion/{split}/{n}/{t}", motion, "read"),
)


def add_routes(app: web.Application) -> None:
    """The viewer's pages and routes on the API's application (``service.serve`` calls it)."""
    app[VIEWER] = Viewer()
    add(app, ROUTES)
