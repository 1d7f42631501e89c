"""One client connection: a reader, and one pump task per request in flight.

Resource handling: everything a connection starts lives in its nursery.  When
the client hangs up (EOF, a reset, or a failed write) the nursery's cancel
scope is cancelled; each pump's ``finally`` then cancels its request in the
decode loop, which frees the request's KV cells before the next tick.  Nothing
else is disturbed, and no exception leaves :meth:`Connection.run` except
``trio.Cancelled``.
"""

from __future__ import annotations

import logging
import math
from contextlib import aclosing
from typing import TYPE_CHECKING

import trio

from ..protocol.codec import decode_client_message, encode_event
from ..protocol.errors import ErrorCode, UmaError
from ..protocol.framing import FrameDecoder
from ..protocol.messages import (
    CancelRequest,
    ClientMessage,
    ErrorEvent,
    GenerateRequest,
    MetricsEvent,
    MetricsRequest,
    PriorityRequest,
    ServerEvent,
    SnapshotRequest,
    TokenEvent,
)
from .delivery import deliver
from .session import Session

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger(__name__)

_READ_SIZE = 65536


class Connection:
    def __init__(self, server: Server, stream: trio.abc.Stream, number: int) -> None:
        self.server = server
        self.config = server.config
        self.loop = server.loop
        self.stream = stream
        self.number = number
        self.requests: dict[str, Session] = {}
        self._send_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._idle_deadline = trio.current_time() + self.config.idle_timeout_s
        self._idle_scope: trio.CancelScope | None = None

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._read_loop()
            # EOF or a fatal error: the client is gone, so are its requests.
            nursery.cancel_scope.cancel()

    async def reject(self, error: UmaError) -> None:
        """Answer a connection we will not serve (too many connections)."""
        await self._send_error(error)

    # -- reading -----------------------------------------------------------------

    async def _read_loop(self) -> None:
        decoder = FrameDecoder(self.config.max_frame_bytes)
        while True:
            with trio.CancelScope(deadline=self._idle_deadline) as scope:
                self._idle_scope = scope
                try:
                    data = await self.stream.receive_some(_READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
            self._idle_scope = None
            if scope.cancelled_caught:
                timeout = self.config.idle_timeout_s
                await self._send_error(
                    UmaError(ErrorCode.IDLE_TIMEOUT, f"connection idle for {timeout:g} s; closing")
                )
                return
            if not data:
                return
            try:
                frames = decoder.feed(data)
            except UmaError as exc:
                await self._send_error(exc)
                return
            arrived = trio.current_time()  # every frame of this read arrived now
            for payload in frames:
                try:
                    await self._dispatch(decode_client_message(payload), arrived)
                except UmaError as exc:
                    await self._send_error(exc)

    async def _dispatch(self, message: ClientMessage, arrived: float) -> None:
        match message:
            case GenerateRequest():
                await self._start_request(message, arrived)
            case CancelRequest(id=request_id):
                self.loop.cancel(self._in_flight(request_id), "client")
            case PriorityRequest(id=request_id, priority=lane):
                self.loop.set_lane(self._in_flight(request_id), lane)
            case MetricsRequest(id=request_id):
                await self._send(MetricsEvent(metrics=self.server.metrics_snapshot(), id=request_id))
            case SnapshotRequest():
                # Saving prefills a whole prompt: answer in its own task, so the reader goes on.
                assert self._nursery is not None
                self._nursery.start_soon(self._snapshot, message)

    def _in_flight(self, request_id: str) -> Session:
        session = self.requests.get(request_id)
        if session is None:
            raise UmaError(
                ErrorCode.UNKNOWN_ID, f"no request {request_id!r} in flight on this connection",
                request_id=request_id,
            )  # fmt: skip
        return session

    async def _start_request(self, request: GenerateRequest, arrived: float) -> None:
        rid = request.id
        if rid in self.requests:
            raise UmaError(ErrorCode.DUPLICATE_ID, f"request {rid!r} is already in flight", request_id=rid)
        if len(self.requests) >= self.config.max_in_flight:
            raise UmaError(
                ErrorCode.TOO_MANY_IN_FLIGHT,
                f"at most {self.config.max_in_flight} requests may be in flight per connection",
                request_id=rid,
            )
        session, receive = await self.server.open_request(request, arrived, connection=self.number)
        self.requests[rid] = session
        self._set_idle_deadline()
        assert self._nursery is not None
        self._nursery.start_soon(self._pump, session, receive)

    async def _snapshot(self, request: SnapshotRequest) -> None:
        """One answer, whatever happens: the event, or an error with the request's id."""
        try:
            await self._send(await self.server.snapshot(request, self.number))
        except UmaError as exc:
            await self._send_error(exc)
        except Exception as exc:  # a bug must not take the connection down unanswered
            log.exception("snapshot %s failed", request.op)
            failed = f"snapshot {request.op} failed: {exc}"
            await self._send_error(UmaError(ErrorCode.SNAPSHOT_INVALID, failed, request_id=request.id))

    # -- writing -----------------------------------------------------------------

    async def _pump(self, session: Session, receive: trio.MemoryReceiveChannel[TokenEvent]) -> None:
        """Forward one request's events to the socket; its end is the request's end."""
        try:
            async with aclosing(deliver(self.server, session, receive)) as events:
                async for event in events:
                    await self._send(event)
        finally:
            # A hang-up lands here through Cancelled; deliver() has cancelled the request.
            del self.requests[session.id]
            self._set_idle_deadline()

    async def _send(self, event: ServerEvent) -> None:
        async with self._send_lock:
            try:
                await self.stream.send_all(encode_event(event))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # The client hung up: end the whole connection, which cancels its
                # requests; inside the nursery the checkpoint raises Cancelled.
                if self._nursery is not None:
                    self._nursery.cancel_scope.cancel()
                await trio.lowlevel.checkpoint()

    async def _send_error(self, error: UmaError) -> None:
        self.server.metrics.on_error(error.code)
        log.debug("connection %d: %s", self.number, error)
        await self._send(ErrorEvent(id=error.request_id, code=error.code, message=error.message))

    def _set_idle_deadline(self) -> None:
        idle = self.config.idle_timeout_s
        self._idle_deadline = math.inf if self.requests else trio.current_time() + idle
        if self._idle_scope is not None:
            self._idle_scope.deadline = self._idle_deadline
