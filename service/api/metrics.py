"""What one server process carried, for Prometheus (``GET /metrics``, its text exposition format),
and the access log line of each request: both made once a response has gone out (``Traffic``,
aiohttp's access logger), so both count the body bytes actually sent (``body_sent``: sendfile's
included; aiohttp's own count, ``body_length``, has the head in it and nothing sendfile sent).

Series (prometheus_client, one registry per application):

    shard_service_requests_total{route, method, status}   requests answered
    shard_service_sent_bytes_total{route}                  body bytes sent (none for what nginx sent)
    shard_service_request_seconds{route}                   histogram: request to its last byte
    shard_service_open_connections                         connections held now (``limits.Admission``)
    shard_service_refused_connections_total                connections refused by the limits (503)
    shard_service_sets{state}                              the catalog's sets by state, at the scrape
    shard_service_catalog_errors_total                     the catalog not reached (a 503, a reap, a scrape)
    shard_service_process{pid, worker, workers}            1: which server process answered the scrape
    process_*                                              prometheus_client's: CPU, memory, open files

``route`` is the route table's path (``Route.pattern``: ``/v1/datasets/{ref}/{path}``), never the
raw URL, and ``method`` one the route answers (a GET route's HEAD is ``HEAD``), so the series are bounded
whatever clients send; a request no route matched (404, 405, a path refused as not plain, one aiohttp could
not parse) is ``other``. Every figure is this process's: under ``serve --workers N`` a scrape is answered by
the worker that accepted its connection, with that worker's figures (docs/service.md).
"""
from __future__ import annotations

import asyncio
import os
from datetime import datetime, timedelta, timezone

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from shards.catalog import Catalog, CatalogUnavailable

from ..limits import Admission
from ..stats import Counters

OTHER = "other"  # the route of a request no route matched
ROW = web.RequestKey("row", object)  # the request's row of a route table, once the middleware admitted it
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Span(web.StreamResponse):
    """A response whose body is written by its own ``prepare`` (``service.api.responses``: sendfile,
    a stream), not by aiohttp; ``sent``: how many of its bytes went out."""

    sent = 0


def body_sent(request: web.BaseRequest, response: web.StreamResponse) -> int:
    """The body bytes ``response`` carried to the client: a span's, or an aiohttp response's body
    once it went out (none for HEAD, 1xx, 204 and 304)."""
    if isinstance(response, Span):
        return response.sent
    if request.method == "HEAD" or response.status in (204, 304) or response.status < 200 \
            or not response.body_length:  # nothing of it went out
        return 0
    return len(getattr(response, "body", None) or b"")


class Metrics:
    """One server process's series; ``admission``: its connections (None: not counted, as under a
    test server that has no admission)."""

    def __init__(self, catalog: Catalog, counters: Counters, admission: Admission | None):
        self.catalog, self.counters, self.admission = catalog, counters, admission
        self.registry = CollectorRegistry()
        self.requests = Counter("shard_service_requests", "requests answered, by route, method and status",
                                ("route", "method", "status"), registry=self.registry)
        self.sent = Counter("shard_service_sent_bytes", "body bytes sent (sendfile's included; none of what "
                            "nginx sent for the server)", ("route",), registry=self.registry)
        self.seconds = Histogram("shard_service_request_seconds",
                                 "seconds from the request to its last byte sent",
                                 ("route",), buckets=SECONDS, registry=self.registry)
        self.catalog_errors = Counter("shard_service_catalog_errors",
                                      "times the catalog could not be reached",
                                      registry=self.registry)
        ProcessCollector(registry=self.registry)
        self.registry.register(self)

    def observe(self, route: str, method: str, status: int, sent: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.sent.labels(route).inc(sent)
        self.seconds.labels(route).observe(seconds)

    def collect(self):
        """The gauges read at the scrape (prometheus_client's custom collector)."""
        process = GaugeMetricFamily("shard_service_process", "the server process that answered this scrape",
                                    labels=("pid", "worker", "workers"))
        process.add_metric((str(os.getpid()), str(self.counters.row), str(self.counters.workers)), 1)
        yield process
        if self.admission is not None:
            yield GaugeMetricFamily("shard_service_open_connections", "connections held now",
                                    value=self.admission.open)
            yield GaugeMetricFamily("shard_service_refused_connections_total",
                                    "connections refused by --max-connections or "
                                    "--max-connections-per-client",
                                    value=self.admission.refused)
        try:
            records = self.catalog.list()
        except CatalogUnavailable:
            self.catalog_errors.inc()
            return
        sets = GaugeMetricFamily("shard_service_sets", "the catalog's sets by state", labels=("state",))
        states = {}
        for rec in records:
            states[rec.state] = states.get(rec.state, 0) + 1
        for state, n in sorted(states.items()):
            sets.add_metric((state,), n)
        yield sets

    async def exposition(self) -> web.Response:
        """The text exposition of every series (in a thread: the scrape reads the catalog)."""
        body = await asyncio.to_thread(generate_latest, self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class Traffic(AbstractAccessLogger):
    """aiohttp's access logger, called once a response has gone out: the request observed in the
    application's ``Metrics`` and, with ``lines``, its access-log line (aiohttp's own format, but
    for the size: the body bytes sent). Bound to an application by ``traffic``."""

    metrics: Metrics
    lines: bool

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        route = request.get(ROW)  # None: no route admitted it (unmatched, refused as not plain, not parsed)
        sent = body_sent(request, response)
        self.metrics.observe(route.pattern if route else OTHER, request.method if route else OTHER,
                             response.status, sent, time)
        if self.lines:
            start = datetime.now(timezone.utc) - timedelta(seconds=time)
            self.logger.info('%s [%s] "%s %s HTTP/%d.%d" %d %d %.6f "%s" "%s"', request.remote,
                             start.strftime("%d/%b/%Y:%H:%M:%S %z"), request.method, request.path_qs,
                             *request.version, response.status, sent, time,
                             request.headers.get("Referer", "-"),
                             request.headers.get("User-Agent", "-"))


def traffic(metrics: Metrics, lines: bool) -> type[Traffic]:
    """``Traffic`` for one application (aiohttp makes its access logger from a class): its
    ``metrics``, and whether access-log lines are written (``--access-log``)."""
    return type("Traffic", (Traffic,), {"metrics": metrics, "lines": lines})
