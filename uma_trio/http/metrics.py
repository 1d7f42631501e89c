"""``--metrics-port``: Prometheus text at ``GET /metrics`` on 127.0.0.1, nothing else.

For scrapers that should not see the gateway (``--http`` serves ``/metrics`` too).
The exposition itself is ``prometheus_client``'s ASGI app; the router around it
sends 404 for other paths (:func:`.serve.serve_asgi` sends no lifespan events) and drops
the query string.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, make_asgi_app

from .serve import AsgiApp, Receive, Scope, Send


def metrics_app(registry: CollectorRegistry) -> AsgiApp:
    prometheus: AsgiApp = make_asgi_app(registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            # The whole exposition, whatever the query: prometheus_client's `name[]` filter
            # skips collectors that describe nothing (the snapshot's, the process's), so it
            # answered nothing but the histograms.
            await prometheus({**scope, "query_string": b""}, receive, send)
        elif scope["type"] == "http":
            await send(
                {"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]}
            )
            await send({"type": "http.response.body", "body": b"not found; try /metrics\n"})

    return app
