"""``--metrics-port``: Prometheus text at ``GET /metrics`` on 127.0.0.1, nothing else.

For scrapers that should not see the gateway (``--http`` serves ``/metrics`` too).
The exposition itself is ``prometheus_client``'s ASGI app; the router around it
sends 404 for other paths (:func:`.serve.serve_asgi` sends no lifespan events), drops the
query string, and answers 403 to a ``Host`` that is not this server's, as the gateway does
(origin.py): a DNS-rebinding page reaches the port under a name of its own.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, make_asgi_app

from ..protocol.errors import shown
from .origin import host_allowed, host_name
from .serve import AsgiApp, Receive, Scope, Send


def metrics_app(registry: CollectorRegistry, hosts: frozenset[str]) -> AsgiApp:
    """The exposition for requests whose ``Host`` is in ``hosts`` (origin.allowed_hosts) or
    an IP address; ``*`` in ``hosts`` allows any."""
    prometheus: AsgiApp = make_asgi_app(registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if "*" not in hosts and not host_allowed(host_name(host), hosts):
            message = f"Host {shown(host)!r} is not this server's (add it with --allowed-hosts)\n"
            await _answer(send, 403, message)
        elif scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            # The whole exposition, whatever the query: prometheus_client's `name[]` filter
            # skips collectors that describe nothing (the snapshot's, the process's), so it
            # answered nothing but the histograms.
            await prometheus({**scope, "query_string": b""}, receive, send)
        else:
            await _answer(send, 404, "not found; try /metrics\n")

    return app


async def _answer(send: Send, status: int, text: str) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]}
    )
    await send({"type": "http.response.body", "body": text.encode()})
