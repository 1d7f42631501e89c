"""Binding a TCP port up front and serving an ASGI app on it with hypercorn's trio worker.

The socket is bound before anything else starts, so a taken port is a one-line
start-up error rather than a failure deep inside a running daemon; hypercorn then
takes the bound socket over (``fd://``).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

log = logging.getLogger(__name__)

# The ASGI types as Starlette spells them, so its apps fit.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BindError(Exception):
    """A port given on the command line could not be bound."""


def bind_tcp(host: str, port: int, what: str) -> socket.socket:
    try:
        return socket.create_server((host, port), family=_family(host))
    except OSError as exc:
        raise BindError(f"cannot serve {what} on {host}:{port}: {exc.strerror or exc}") from None


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name: let getaddrinfo pick
        return socket.AF_INET


def url_of(sock: socket.socket, *, https: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if https else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def serve_asgi(
    app: AsgiApp,
    sock: socket.socket,
    *,
    name: str,
    tls: tuple[Path, Path] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on the bound ``sock`` until cancelled; ``task_status.started`` gets
    the base URL.  ``name`` names hypercorn's error logger; ``tls`` is a certificate chain
    and private key file to serve HTTPS with."""
    url = url_of(sock, https=tls is not None)
    config = Config()
    if tls is not None:
        config.certfile, config.keyfile = str(tls[0]), str(tls[1])
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = logging.getLogger(f"uma_trio.{name}")
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, app, config)
        task_status.started(url)
