"""The HTTP API on aiohttp's server, all under ``/v1``, in files by concern (aiohttp-demos' shape):

    app.py         the application factory (``make_app``) and its lifecycle
    keys.py        the typed application keys
    routes.py      the route table: every route with its view and access level (the only list)
    middleware.py  plain paths, access enforced from the route table, JSON errors
    sets.py        the request's set and its files (409 and 410 for sets not served)
    responses.py   the bytes out (sendfile, streamed, ranges) and cache control
    metrics.py     what each response carried: GET /metrics (Prometheus) and the access log
    views.py       the views

The viewer (``service.viewer``) adds its own table of the same rows; what each route answers is
docs/service.md's.
"""
