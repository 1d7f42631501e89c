"""New HTTP connections count as requests on their way in until their first request is read.

An idle decode task woken by a request waits a moment for the rest of a burst
(``DecodeLoop._gather_burst``), for as long as other requests are on their way in
(``DecodeLoop.arrivals``).  A request is marked from the moment the gateway's handler
starts; before that, a client that opens a connection per request (the first burst from
any HTTP client pool, a script, ``curl``) spends a few milliseconds connecting, and on the
H100 the first request of such a burst of 16 started alone while the rest joined at the pace
its stream allowed, a few dozen prompt tokens a tick.  So a connection just accepted counts
as arriving until its first request reaches the app, for ``window_s`` at most (a connection
that never sends one holds nothing longer).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import trio

from .serve import AsgiApp, Receive, Scope, Send

Peer = tuple[str, int]


class FreshConnections:
    def __init__(self, window_s: float = 0.025, linger_s: float = 0.001) -> None:
        self.window_s = window_s
        # Held a moment past the first request's arrival, so the mark hands over to the
        # handler's own (it starts after the middleware) without a gap.
        self.linger_s = linger_s
        self._pending: dict[Peer, trio.Event] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def watch(self, peer: Peer, arriving: Callable[[], AbstractContextManager[None]]) -> None:
        """Hold ``arriving()`` from the connection's accept until its first request is seen."""
        event = self._pending[peer] = trio.Event()
        try:
            with arriving(), trio.move_on_after(self.window_s):
                await event.wait()
                await trio.sleep(self.linger_s)
        finally:
            if self._pending.get(peer) is event:
                del self._pending[peer]

    def seen(self, peer: Peer | None) -> None:
        if peer is not None and (event := self._pending.get(peer)) is not None:
            event.set()

    def wrap(self, app: AsgiApp) -> AsgiApp:
        """``app``, telling this registry when each request reaches it."""

        async def seen_first(scope: Scope, receive: Receive, send: Send) -> None:
            client = scope.get("client")
            if scope["type"] == "http" and client:
                self.seen((str(client[0]), int(client[1])))
            await app(scope, receive, send)

        return seen_first


def peer_of(stream: object) -> Peer | None:
    """The remote address of an accepted TCP (or TLS over TCP) stream, as ASGI's ``client``."""
    transport = getattr(stream, "transport_stream", stream)
    sock = getattr(transport, "socket", None)
    try:
        address = sock.getpeername() if sock is not None else None
    except OSError:
        return None
    if not isinstance(address, tuple) or len(address) < 2:
        return None
    return str(address[0]), int(address[1])
