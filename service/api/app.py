"""The application factory and its lifecycle: ``make_app`` puts the catalog, tokens and the
server's state on the application (``service.api.keys``), the middleware in front
(``service.api.middleware``) and the API's route table (``service.api.routes``) behind it;
``service.serve`` adds the viewer's table (``service.viewer``) and runs it. While it runs, builds
whose builder died are looked for every ``REAP_SECONDS``; on shutdown the builds it runs stop."""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from shards.catalog import Catalog, CatalogUnavailable

from ..accel import Front
from ..builds import Builds
from ..limits import Admission, OutOfFiles
from ..records import STALE_SECONDS, RecordCache
from ..roots import SourceRoots
from ..stats import Counters
from ..tables import FileTables
from . import routes
from .keys import (
    ACCEL,
    BODY_TIMEOUT,
    BUILDS,
    CATALOG,
    COUNTERS,
    FILES_LOG,
    METRICS,
    READ_AUTH,
    RECORDS,
    REDIRECT,
    TABLES,
    TOKENS,
)
from .metrics import Metrics
from .middleware import json_errors

log = logging.getLogger("service.api")
MAX_BODY = 64 * 1024
REAP_SECONDS = 15  # how often builds whose builder died are looked for


async def _reap_periodically(app: web.Application):
    async def reap():
        """Builds asked for over HTTP whose builder died are taken over (``service.builds``); any
        other build whose builder died is marked failed."""
        try:
            await app[BUILDS].take_over()
            for dataset in await asyncio.to_thread(app[CATALOG].reap):
                log.warning("build %s: its builder died; marked failed", dataset)
        except CatalogUnavailable as e:
            app[METRICS].catalog_errors.inc()
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
             redirect_seconds: int = 0, front: Front | None = None,
             admission: Admission | None = None, catalog_staleness: float = STALE_SECONDS) -> web.Application:
    app = web.Application(middlewares=[json_errors], client_max_size=MAX_BODY)
    app[CATALOG], app[TOKENS], app[READ_AUTH] = catalog, list(tokens), read_auth
    app[COUNTERS], app[REDIRECT], app[ACCEL] = counters or Counters(), redirect_seconds, front
    app[METRICS] = Metrics(catalog, app[COUNTERS], admission)
    app[TABLES] = FileTables(catalog, app[COUNTERS])
    app[RECORDS] = RecordCache(catalog, stale_seconds=catalog_staleness)
    app[BODY_TIMEOUT], app[FILES_LOG] = body_timeout, out_of_files or OutOfFiles()
    app[BUILDS] = Builds(catalog, data_root, ray_address, roots=source_roots, max_workers=max_build_workers,
                         max_running=max_builds)
    app.cleanup_ctx.append(_reap_periodically)
    app.on_shutdown.append(_stop_builds)
    app.on_cleanup.append(_close_records)
    routes.add(app, routes.ROUTES)
    return app
