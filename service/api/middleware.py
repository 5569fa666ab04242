"""The middleware every request passes: plain paths, the route's access, JSON errors.

Request paths must be plain: percent-escapes, backslashes, dot segments and empty segments are
refused (400) before routing. Then the route's access level (``service.api.routes``) is enforced
before its view runs: a bearer token for ``write`` always, for ``read`` with ``read_auth``; 401
without one, 403 with a wrong one. A matched route that no route table registered is an internal
error, never served. Errors are JSON ``{"error": ..., "status": ...}``, each one line; an
unexpected one is logged and the server serves on.
"""
from __future__ import annotations

import hmac
import logging
import re

from aiohttp import web

from shards.base.errors import DataFault
from shards.catalog import CatalogUnavailable
from shards.format.checks import BadManifest

from ..files import Refused
from ..limits import OUT_OF_FILES
from .keys import COUNTERS, FILES_LOG, METRICS, READ_AUTH, SERVED, TOKENS
from .metrics import ROW
from .responses import error

log = logging.getLogger("service.api")
_PLAIN_PATH = re.compile(r"(/[A-Za-z0-9_\-~]+(\.[A-Za-z0-9_\-~]+)*)*/?")


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
        raise web.HTTPForbidden(text="wrong token" if tokens else "writes are disabled: the server has no "
                                "--token-file")


def _admit(request: web.Request) -> None:
    """Enforce the matched route's access level (none for aiohttp's own 404 and 405); its row is
    kept on the request (``ROW``: the route the metrics count it under)."""
    if request.match_info.http_exception is not None:
        return
    route = request.app[SERVED].get(request.match_info.route)
    if route is None:
        raise LookupError(f"{request.method} {request.match_info.route.resource.canonical} is in no route "
                          f"table")
    request[ROW] = route
    if route.access == "write" or (route.access == "read" and request.app[READ_AUTH]):
        _authorised(request)


@web.middleware
async def json_errors(request: web.Request, handler):
    """Refuse unplain paths; admit by the route's access; answer every error as JSON; log unexpected
    ones and serve on."""
    request.app[COUNTERS].add("requests")
    raw = request.raw_path.split("?", 1)[0]
    if not _PLAIN_PATH.fullmatch(raw):
        return error(400,
                     "request path must be plain: no escapes, dot segments, backslashes or empty segments")
    try:
        _admit(request)
        response = await handler(request)
        response.headers.setdefault("Cache-Control", "no-store")
        return response
    except CatalogUnavailable as e:
        request.app[METRICS].catalog_errors.inc()
        log.warning("%s %s: %s", request.method, request.path, e)
        return error(503, "the catalog cannot be reached; try again shortly", **{"Retry-After": "1"})
    except Refused as e:
        return error(e.status, str(e))
    # the set's bytes refuse a reader: its state, not the request, is wrong
    except (BadManifest, DataFault) as e:
        log.warning("%s %s: %s", request.method, request.path, e)
        return error(409,
                     f"{e} (shard-service verify marks the set; shards verify names every damaged sample)")
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
