"""``uma-trio ps|load|unload``: the daemon's models and their state (docs/MODELS.md)."""

from __future__ import annotations

from pathlib import Path

import anyio

from ..client import ConnectionLost, RequestFailed, UmaClient
from ..config import DEFAULT_SOCKET
from ..protocol.messages import ModelsEvent
from .common import SocketPath, daemon_failure


def ps(*, socket: SocketPath = DEFAULT_SOCKET) -> int:
    """List the daemon's models: loaded, loading or not, with their files and sizes.

    Parameters
    ----------
    socket
        Unix socket path of the daemon.
    """
    return _models(socket, "list", None, None)


def load(model: str, *, keep_alive: float | None = None, socket: SocketPath = DEFAULT_SOCKET) -> int:
    """Load a model of the daemon's store now, before a request needs it.

    Parameters
    ----------
    model
        The model's id, file name or alias.
    keep_alive
        Seconds it stays loaded once idle (negative: for good); default the daemon's --keep-alive.
    socket
        Unix socket path of the daemon.
    """
    return _models(socket, "load", model, keep_alive)


def unload(model: str, *, socket: SocketPath = DEFAULT_SOCKET) -> int:
    """Unload a model (at once if idle, else when its requests are done); --model's stays.

    Parameters
    ----------
    model
        The model's id, file name or alias.
    socket
        Unix socket path of the daemon.
    """
    return _models(socket, "unload", model, None)


def _models(socket: Path, op: str, model: str | None, keep_alive: float | None) -> int:
    async def ask() -> ModelsEvent:
        async with UmaClient.connect(socket) as client:
            fields = {} if keep_alive is None else {"keep_alive": keep_alive}
            return await client.models(op, model, **fields)

    try:
        event = anyio.run(ask)
    except (RequestFailed, ConnectionLost, OSError) as exc:
        return daemon_failure(socket, exc)
    for m in event.models:
        note = " (--model)" if m["primary"] else ""
        aliases = f", also {', '.join(m['aliases'])}" if m["aliases"] else ""
        print(f"{m['id']:<40} {m['state']:<9} {m['bytes'] / 2**20:8.0f} MiB  {m['file']}{note}{aliases}")
    return 0
