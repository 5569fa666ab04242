"""The route table: every route the server answers is a row ``Route(method, path, view, access)``,
and nothing else registers one (``add``), so a route cannot exist without its access level, which
the middleware enforces before the view runs (``service.api.middleware``):

    open   no token, ever: nothing of a set's data (where things are, liveness, the viewer's shells)
    read   a bearer token with ``--read-auth``; without it, anyone who reaches the port
    write  always a bearer token (without ``--token-file`` every write is refused)

A GET route answers HEAD too. ``GET /v1`` lists the routes of the running application, and
docs/service.md's route tables are tested against these rows (tests/test_service_edges.py).
The viewer's routes are a table of the same rows (``service.viewer.ROUTES``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web

from . import views
from .keys import SERVED

LEVELS = ("open", "read", "write")
METHODS = ("GET", "PUT", "POST", "DELETE")


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # aiohttp's pattern: ``{name}``, or ``{name:regex}``
    view: Callable[[web.Request], Awaitable[web.StreamResponse]]
    access: str  # one of LEVELS

    def __post_init__(self):
        if self.method not in METHODS or self.access not in LEVELS:
            raise ValueError(f"route {self.method} {self.path}: a method of {METHODS} and an access of "
                             f"{LEVELS}")

    @property
    def pattern(self) -> str:
        """The path as people read it: ``{name}`` for every variable part, its regex left out."""
        return re.sub(r"\{(\w+):[^}]*\}", r"{\1}", self.path)

    def listed(self) -> dict:
        return {"method": self.method, "path": self.pattern, "access": self.access}


ROUTES = (
    Route("GET", "/v1", views.index, "open"),
    Route("GET", "/v1/health", views.health, "open"),
    Route("GET", "/v1/stats", views.stats, "read"),  # the server's pid and traffic
    Route("GET", "/metrics", views.metrics, "read"),  # the same, for Prometheus (where its scrapers look)
    Route("GET", "/v1/datasets", views.list_datasets, "read"),
    Route("GET", "/v1/datasets/{ref}", views.show_dataset, "read"),
    Route("DELETE", "/v1/datasets/{ref}", views.delete_dataset, "write"),
    Route("PUT", "/v1/datasets/{ref}/tags/{tag}", views.put_tag, "write"),
    Route("DELETE", "/v1/datasets/{ref}/tags/{tag}", views.delete_tag, "write"),
    Route("GET", "/v1/datasets/{ref}/{path:.+}", views.get_file, "read"),
    Route("POST", "/v1/builds", views.post_build, "write"),
    Route("GET", "/v1/builds/{id}", views.get_build, "read"),
)


def add(app: web.Application, table: tuple[Route, ...]) -> None:
    """Register ``table``'s rows on ``app`` (a GET with its HEAD), each aiohttp route mapped to its row."""
    served = app.setdefault(SERVED, {})
    for route in table:
        resource = app.router.add_resource(route.path)
        for method in ("HEAD", "GET") if route.method == "GET" else (route.method,):
            served[resource.add_route(method, route.view)] = route
