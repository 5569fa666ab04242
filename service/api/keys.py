"""The application's typed keys (``aiohttp.web.AppKey``): what ``service.api.app.make_app`` puts on
the application and every view and middleware reads."""
from __future__ import annotations

from aiohttp import web

from shards.catalog import Catalog

from ..accel import Front
from ..builds import Builds
from ..limits import OutOfFiles
from ..records import RecordCache
from ..stats import Counters
from ..tables import FileTables
from .metrics import Metrics

CATALOG = web.AppKey("catalog", Catalog)
BUILDS = web.AppKey("builds", Builds)
TOKENS = web.AppKey("tokens", list)
READ_AUTH = web.AppKey("read_auth", bool)
TABLES = web.AppKey("tables", FileTables)
RECORDS = web.AppKey("records", RecordCache)
COUNTERS = web.AppKey("counters", Counters)
REDIRECT = web.AppKey("redirect_seconds", int)
ACCEL = web.AppKey("front", Front)  # None: no nginx sends files for the server
METRICS = web.AppKey("metrics", Metrics)
FILES_LOG = web.AppKey("out_of_files", OutOfFiles)
BODY_TIMEOUT = web.AppKey("body_timeout", float)
SERVED = web.AppKey("served", dict)  # aiohttp's route -> its row of a route table (service.api.routes)
