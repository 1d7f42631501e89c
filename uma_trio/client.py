"""A small anyio client for the daemon: usable from trio and asyncio apps alike.

    async with UmaClient.connect() as client:
        async with client.stream(prompt="Hello", max_tokens=32) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    print(event.text, end="")

With no path ``connect`` reaches the socket the client commands would
(:func:`uma_trio.config.client_socket_path`): ``UMA_SOCKET``, else ``UMA_SOCK``, else
where ``uma-trio serve`` listens by default, ``$XDG_RUNTIME_DIR/uma-trio/uma.sock`` or
``/tmp/uma-trio-<uid>/uma.sock``.  Before anything is sent, ``connect`` asks the
kernel which user the daemon runs as and refuses (:class:`UntrustedDaemon`) one
that runs as neither this user nor root: an impostor listening where the daemon
should be would otherwise see every prompt (docs/SECURITY.md).

Several requests may be in flight on one client at once; one reader task
routes the daemon's events to each request by id.  Leaving a ``stream`` block
before its ``eos`` cancels the request on the daemon.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
from anyio.abc import SocketAttribute, SocketStream, TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .config import client_socket_path
from .protocol.codec import decode_server_event, encode_message, is_request_id
from .protocol.errors import UmaError
from .protocol.framing import FrameDecoder
from .protocol.messages import (
    EosEvent,
    ErrorEvent,
    MetricsEvent,
    ModelsEvent,
    ServerEvent,
    SnapshotEvent,
    TokenEvent,
)
from .runtime.peer import peer_uid

_ids = itertools.count(1)
E = TypeVar("E", MetricsEvent, SnapshotEvent, ModelsEvent)


class ConnectionLost(Exception):
    """The daemon closed the connection or sent something unreadable."""


class UntrustedDaemon(ConnectionError):
    """The process listening on the socket runs as another user (neither this one nor root)."""


class RequestFailed(Exception):
    """The daemon answered a request with an ``error`` event."""

    def __init__(self, event: ErrorEvent) -> None:
        super().__init__(f"{event.code}: {event.message}")
        self.event = event


@dataclass
class Completion:
    text: str
    eos: EosEvent


class UmaClient:
    def __init__(self, stream: SocketStream, task_group: TaskGroup) -> None:
        self._stream = stream
        self._task_group = task_group
        self._routes: dict[str | None, MemoryObjectSendStream[ServerEvent | Exception]] = {}
        self._send_lock = anyio.Lock()
        self._closed: Exception | None = None
        self._connection_error: ErrorEvent | None = None  # the last one with no request id
        self._reader_done = anyio.Event()

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, path: str | os.PathLike[str] | None = None, *, max_frame_bytes: int = 1 << 24
    ) -> AsyncIterator[UmaClient]:
        path = client_socket_path() if path is None else path
        stream = await anyio.connect_unix(os.fspath(Path(path)))
        try:
            _check_daemon_user(stream, path)
        except BaseException:
            await anyio.aclose_forcefully(stream)
            raise
        try:
            async with stream, anyio.create_task_group() as tg:
                client = cls(stream, tg)
                tg.start_soon(client._read_loop, max_frame_bytes)
                try:
                    yield client
                finally:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Callers should see the one error that happened, not the task group's wrapper.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    @property
    def connection_error_code(self) -> str | None:
        """The code of the last connection-level error the daemon sent (one with no request id,
        e.g. E_LIMIT_006 before it hangs up), or None: why a lost connection was lost."""
        return None if self._connection_error is None else self._connection_error.code

    # -- requests ----------------------------------------------------------------

    @asynccontextmanager
    async def stream(self, **request: Any) -> AsyncIterator[AsyncIterator[ServerEvent]]:
        """Send a generate request; iterate its events up to and including the last."""
        request_id = str(request.setdefault("id", f"req-{os.getpid()}-{next(_ids)}"))
        _check_id(request_id)
        receive = self._route(request_id)
        finished = False

        async def events() -> AsyncIterator[ServerEvent]:
            nonlocal finished
            async for item in receive:
                if isinstance(item, Exception):
                    finished = True
                    raise item
                # Mark the end before yielding: a caller may stop iterating at the eos itself,
                # and a cancel for a finished request would be an E_PROTO_007 error.  An error
                # without an id (the connection's, heard by every stream) ends the stream here
                # but not the request: leaving sends its cancel if the connection is still up.
                last = isinstance(item, (EosEvent, ErrorEvent))
                finished = finished or (last and item.id == request_id)
                yield item
                if last:
                    return

        try:
            await self.send(request)
            yield events()
        finally:
            self._routes.pop(request_id, None)
            if not finished and self._closed is None:
                with anyio.CancelScope(shield=True), contextlib.suppress(ConnectionLost):
                    await self.send({"type": "cancel", "id": request_id})

    async def complete(self, **request: Any) -> Completion:
        """Run a request to its end; raise :class:`RequestFailed` on an error event."""
        parts: list[str] = []
        async with self.stream(**request) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    parts.append(event.text)
                elif isinstance(event, ErrorEvent):
                    raise RequestFailed(event)
                elif isinstance(event, EosEvent):
                    return Completion(event.text if event.text is not None else "".join(parts), event)
        raise ConnectionLost("the stream ended without an eos event")

    async def cancel(self, request_id: str) -> None:
        _check_id(request_id)
        await self.send({"type": "cancel", "id": request_id})

    async def metrics(self) -> dict[str, Any]:
        event = await self._ask({"type": "metrics"}, MetricsEvent)
        return event.metrics

    async def snapshot(self, op: str, name: str | None = None, **fields: Any) -> SnapshotEvent:
        """Save (``prompt=`` or ``messages=``), restore or list KV snapshots (docs/PROTOCOL.md)."""
        message: dict[str, Any] = {"type": "snapshot", "op": op, **fields}
        if name is not None:
            message["name"] = name
        return await self._ask(message, SnapshotEvent)

    async def models(self, op: str = "list", model: str | None = None, **fields: Any) -> ModelsEvent:
        """List the daemon's models, or load or unload one (docs/MODELS.md)."""
        message: dict[str, Any] = {"type": "models", "op": op, **fields}
        if model is not None:
            message["model"] = model
        return await self._ask(message, ModelsEvent)

    async def _ask(self, message: dict[str, Any], answer: type[E]) -> E:
        """Send a request that is answered by one event of type ``answer``, or an error."""
        request_id = f"{message['type']}-{next(_ids)}"
        receive = self._route(request_id)
        try:
            await self.send({**message, "id": request_id})
            async for item in receive:
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, answer):
                    return item
                if isinstance(item, ErrorEvent):
                    raise RequestFailed(item)
        finally:
            self._routes.pop(request_id, None)
        raise ConnectionLost(f"no {message['type']} answer")

    async def send(self, message: dict[str, Any]) -> None:
        """Send one raw message (a dict); for callers that speak the protocol directly."""
        if self._closed is not None:
            raise self._closed
        async with self._send_lock:
            try:
                await self._stream.send(encode_message(message))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                # The daemon may have said why before hanging up (E_AUTH_001): let the reader
                # take in what is already here.
                with anyio.move_on_after(1.0, shield=True):
                    await self._reader_done.wait()
                reason = self._hang_up_reason() if self._connection_error else exc
                raise ConnectionLost(f"cannot send to the daemon: {reason}") from exc

    # -- plumbing ----------------------------------------------------------------

    def _route(self, request_id: str) -> MemoryObjectReceiveStream[ServerEvent | Exception]:
        if request_id in self._routes:  # its events would go to the newer stream, then nowhere
            raise ValueError(f"request id {request_id!r} is already in flight on this client")
        send, receive = anyio.create_memory_object_stream[ServerEvent | Exception](float("inf"))
        self._routes[request_id] = send
        return receive

    def _hang_up_reason(self) -> str:
        """The daemon closed the connection, and why if it said so (a connection-level error)."""
        error = self._connection_error
        after = "" if error is None else f" after {error.code}: {error.message}"
        return f"the daemon closed the connection{after}"

    async def _read_loop(self, max_frame_bytes: int) -> None:
        decoder = FrameDecoder(max_frame_bytes)
        try:
            while True:
                try:
                    data = await self._stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    raise ConnectionLost(self._hang_up_reason()) from None
                for payload in decoder.feed(data):
                    self._deliver(decode_server_event(payload))
        except (ConnectionLost, UmaError) as exc:
            error = exc if isinstance(exc, ConnectionLost) else ConnectionLost(str(exc))
            self._closed = error
            for route in list(self._routes.values()):
                route.send_nowait(error)
        finally:
            self._reader_done.set()

    def _deliver(self, event: ServerEvent) -> None:
        route = self._routes.get(event.id)
        if route is not None:
            route.send_nowait(event)
        elif event.id is None and isinstance(event, ErrorEvent):
            # A connection-level error (idle timeout, bad frame, E_AUTH_001): everyone hears
            # it, and the hang-up that usually follows names it.
            self._connection_error = event
            for other in list(self._routes.values()):
                other.send_nowait(event)


def _check_id(request_id: str) -> None:
    """A request id the daemon accepts (PROTOCOL.md): a bad one was refused by an error with
    no id, which every stream of the connection heard as its own end."""
    if not is_request_id(request_id):
        raise ValueError(f"request id {request_id!r}: 1 to 128 printable ASCII characters, no spaces")


def _check_daemon_user(stream: SocketStream, path: str | os.PathLike[str]) -> None:
    """Refuse a daemon that runs as another user; where the platform cannot tell, trust the
    socket's 0600 mode and private directory."""
    uid = peer_uid(stream.extra(SocketAttribute.raw_socket))
    me = os.geteuid()
    if uid is not None and uid not in (me, 0):
        raise UntrustedDaemon(
            f"the daemon on {os.fspath(path)} runs as uid {uid}, not as you (uid {me}); "
            "refusing to send it anything"
        )
