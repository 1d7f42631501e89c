"""``--metrics-port``: Prometheus text at ``GET /metrics``, on hypercorn's trio worker.

A stop-gap until the HTTP gateway exists: it binds loopback only and serves
nothing else.  The exposition itself is ``prometheus_client``'s ASGI app; the
router around it only answers ASGI lifespan events (which that app does not
handle) and sends 404 for other paths.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client import CollectorRegistry, make_asgi_app

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def metrics_app(registry: CollectorRegistry) -> AsgiApp:
    prometheus: AsgiApp = make_asgi_app(registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            await prometheus(scope, receive, send)
        elif scope["type"] == "http":
            await send(
                {"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]}
            )
            await send({"type": "http.response.body", "body": b"not found; try /metrics\n"})

    return app


class MetricsPortError(Exception):
    """The ``--metrics-port`` could not be bound."""


def bind_metrics_port(port: int) -> socket.socket:
    """Bind loopback ``port`` before anything starts, so a taken port is a start-up error."""
    try:
        return socket.create_server(("127.0.0.1", port))
    except OSError as exc:
        raise MetricsPortError(f"cannot serve metrics on 127.0.0.1:{port}: {exc.strerror}") from None


async def serve_metrics_http(
    registry: CollectorRegistry,
    sock: socket.socket,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve on the bound ``sock`` (hypercorn takes it over) until cancelled;
    ``task_status.started`` gets the URL."""
    host, port = sock.getsockname()[:2]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("uma_trio.metrics_http")
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, metrics_app(registry), config)
        url = f"http://{host}:{port}/metrics"
        log.info("Prometheus metrics on %s", url)
        task_status.started(url)
