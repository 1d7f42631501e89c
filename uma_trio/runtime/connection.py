"""One client connection: a reader, and one pump task per request in flight.

Resource handling: everything a connection starts lives in its nursery.  When
the client hangs up (EOF, a reset, or a failed write) the nursery's cancel
scope is cancelled; each pump's ``finally`` then cancels its request in the
decode loop, which frees the request's KV cells before the next tick.  Nothing
else is disturbed, and no exception leaves :meth:`Connection.run` except
``trio.Cancelled``.

Clients that stop half-way are cut off on timers, so they hold nothing for
long: a connection with nothing in flight after ``idle_timeout_s``; a frame
begun but not finished within ``frame_timeout_s``; and a client whose socket
accepts none of its events for ``stall_timeout_s`` (its requests are parked
meanwhile, then cancelled with ``cancel_reason="stalled"``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import aclosing

import trio

from ..protocol.codec import decode_client_message, encode_event
from ..protocol.errors import ErrorCode, UmaError, shown
from ..protocol.framing import FrameDecoder
from ..protocol.messages import (
    CancelRequest,
    ClientMessage,
    EosEvent,
    ErrorEvent,
    GenerateRequest,
    MetricsEvent,
    MetricsRequest,
    ModelsRequest,
    PriorityRequest,
    ServerEvent,
    SnapshotRequest,
    Timings,
    Usage,
)
from .delivery import WRITE_TOGETHER_BYTES, deliver
from .desk import RequestDesk
from .stream import RequestStream
from .write_now import write_now

log = logging.getLogger(__name__)

_READ_SIZE = 65536


class Connection:
    def __init__(self, server: RequestDesk, stream: trio.abc.Stream, number: int, owner: str = "") -> None:
        self.server = server
        self.owner = owner  # its requests' principal (prefix-cache partition)
        self.config = server.config
        self.loop = server.loop
        self.stream = stream
        self.number = number
        self.requests: dict[str, RequestStream] = {}
        # Requests being admitted (tokenized, their grammar compiled, their model loaded) in
        # their own tasks, and what the client asked of each meanwhile (a cancel, a lane).
        self._admitting: dict[str, list[Callable[[RequestStream], None]]] = {}
        # Requests being admitted, each in a scope its client's cancel stops: one cancelled
        # while its 1,500-rule grammar compiled held the next request 11.7 s behind it.
        self._admission_scopes: dict[str, trio.CancelScope] = {}
        self._admitted_last: trio.Event | None = None  # set once the last one sent is queued
        self._send_lock = trio.Lock()
        # The socket's descriptor, for writes that need not wait (-1: not a socket stream).
        self._fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        self._nursery: trio.Nursery | None = None
        self._idle_deadline = trio.current_time() + self.config.idle_timeout_s
        self._snapshots = 0  # snapshot requests answered in their own tasks, not yet answered
        self._answering: set[str] = set()  # the ids of those that have one
        self._frame_deadline = math.inf  # set while part of a frame is buffered
        self._read_scope: trio.CancelScope | None = None

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
            with trio.CancelScope(deadline=self._read_deadline()) as scope:
                self._read_scope = scope
                try:
                    data = await self.stream.receive_some(_READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
            self._read_scope = None
            if scope.cancelled_caught:
                await self._send_error(self._read_timeout(decoder.buffered))
                return
            if not data:
                return
            try:
                frames = decoder.feed(data)
            except UmaError as exc:
                await self._send_error(exc)
                return
            arrived = trio.current_time()  # every frame of this read arrived now
            new_frame = bool(frames) or self._frame_deadline == math.inf
            for i, payload in enumerate(frames):
                if i:  # a read of many frames: the other connections get their turn between them
                    await trio.lowlevel.checkpoint()
                try:
                    await self._dispatch(decode_client_message(payload), arrived)
                except UmaError as exc:
                    await self._send_error(exc)
            if frames:
                self._set_idle_deadline()  # any message is activity (a metrics poller is not idle)
            # From now, not from the read: dispatching may have waited on a slow write.
            if not decoder.buffered:
                self._frame_deadline = math.inf
            elif new_frame:
                self._frame_deadline = trio.current_time() + self.config.frame_timeout_s

    async def _dispatch(self, message: ClientMessage, arrived: float) -> None:
        match message:
            case GenerateRequest():
                await self._start_request(message, arrived)
            case CancelRequest(id=request_id):
                if (admission := self._admission_scopes.get(request_id)) is not None:
                    admission.cancel()  # still being admitted (a grammar compiling): it ends now
                else:
                    self._on_admitted(request_id, lambda stream: stream.cancel("client"))
            case PriorityRequest(id=request_id, priority=lane):
                self._on_admitted(request_id, lambda stream: stream.set_lane(lane))
            case MetricsRequest(id=request_id):
                try:  # a figure that cannot be read fails this request, not the connection
                    metrics = self.server.metrics_snapshot()
                except Exception as exc:
                    log.exception("connection %d: the metrics snapshot failed", self.number)
                    failed = f"the metrics could not be read: {exc}"
                    raise UmaError(ErrorCode.INTERNAL, failed, request_id=request_id) from None
                await self._send(MetricsEvent(metrics=metrics, id=request_id))
            case SnapshotRequest() | ModelsRequest():
                # Saving prefills a whole prompt, loading reads a model: answer in its own task,
                # so the reader goes on.  It counts as in flight: against --max-in-flight, and
                # the connection is not idle while it waits for the answer.
                if message.id is not None:
                    self._refuse_taken(message.id)
                self._check_room(message.id)
                if message.id is not None:
                    self._answering.add(message.id)
                self._snapshots += 1
                self._set_idle_deadline()
                assert self._nursery is not None
                self._nursery.start_soon(self._answer, message)

    def _read_deadline(self) -> float:
        return min(self._idle_deadline, self._frame_deadline)

    def _read_timeout(self, buffered: int) -> UmaError:
        if self._frame_deadline <= self._idle_deadline:
            timeout = self.config.frame_timeout_s
            return UmaError(
                ErrorCode.FRAME_TIMEOUT,
                f"a frame begun was not complete after {timeout:g} s ({buffered} bytes arrived); closing",
            )
        idle = self.config.idle_timeout_s
        return UmaError(ErrorCode.IDLE_TIMEOUT, f"connection idle for {idle:g} s; closing")

    def _on_admitted(self, request_id: str, action: Callable[[RequestStream], None]) -> None:
        """``action`` on the request in flight, now, or once it is admitted."""
        if (stream := self.requests.get(request_id)) is not None:
            action(stream)
        elif (pending := self._admitting.get(request_id)) is not None:
            pending.append(action)
        else:
            raise UmaError(
                ErrorCode.UNKNOWN_ID, f"no request {request_id!r} in flight on this connection",
                request_id=request_id,
            )  # fmt: skip

    async def _start_request(self, request: GenerateRequest, arrived: float) -> None:
        rid = request.id
        self._refuse_taken(rid)
        self._check_room(rid)
        self.server.clients.sent(self)
        # Admitted in a task of its own: a long one (a big grammar's compile, a model loading)
        # once held this reader, so the client's cancel of another request waited behind it.
        self._admitting[rid] = []
        self._set_idle_deadline()
        before, self._admitted_last = self._admitted_last, trio.Event()
        assert self._nursery is not None
        self._nursery.start_soon(self._admit, request, arrived, before, self._admitted_last)

    def _refuse_taken(self, rid: str) -> None:
        """E_PROTO_006 for an id in flight: a request's, or an unanswered snapshot or models
        request's (answers to both came back under one id, which a client cannot tell apart)."""
        if rid in self.requests or rid in self._admitting or rid in self._answering:
            raise UmaError(ErrorCode.DUPLICATE_ID, f"request {rid!r} is already in flight", request_id=rid)

    async def _admit(
        self, request: GenerateRequest, arrived: float, before: trio.Event | None, done: trio.Event
    ) -> None:
        """Queue the request once the one sent before it on this connection is queued (in the
        order the client sent them), then pump its events."""
        rid = request.id
        scope = self._admission_scopes[rid] = trio.CancelScope()
        try:
            with scope:
                if before is not None:
                    await before.wait()
                opened = self.server.open_request(request, arrived, connection=self.number, owner=self.owner)
                stream = await opened
            if scope.cancelled_caught:  # the client's cancel, before the request was queued
                now = trio.current_time()
                self.server.metrics.on_finished(
                    request.priority, "cancelled", now, computed_tokens=0, cancel_reason="client"
                )
                await self._send(cancelled_before_queued(rid, arrived))
                return
        except UmaError as exc:
            await self._send_error(exc)
            return
        else:
            self.requests[rid] = stream
            if scope.cancel_called:  # a cancel that came while a thread held it (its model loading)
                stream.cancel("client")  # and was queued before any checkpoint could deliver it
            for action in self._admitting[rid]:
                action(stream)
        finally:
            done.set()
            del self._admitting[rid], self._admission_scopes[rid]
            self._set_idle_deadline()
        await self._pump(stream)

    def _check_room(self, request_id: str | None) -> None:
        if len(self.requests) + len(self._admitting) + self._snapshots >= self.config.max_in_flight:
            raise UmaError(
                ErrorCode.TOO_MANY_IN_FLIGHT,
                f"at most {self.config.max_in_flight} requests may be in flight per connection",
                request_id=request_id,
            )

    async def _answer(self, request: SnapshotRequest | ModelsRequest) -> None:
        """One answer, whatever happens: the event, or an error with the request's id."""
        try:
            if isinstance(request, SnapshotRequest):
                await self._send(await self.server.snapshot(request, self.number, self.owner))
            else:
                await self._send(await self.server.models_op(request))
        except UmaError as exc:
            await self._send_error(exc)
        except Exception as exc:  # a bug must not take the connection down unanswered
            log.exception("%s %s failed", request.type, request.op)
            failed = f"{request.type} {request.op} failed: {exc}"
            snapshot = isinstance(request, SnapshotRequest)
            code = ErrorCode.SNAPSHOT_INVALID if snapshot else ErrorCode.MODEL_LOAD
            await self._send_error(UmaError(code, failed, request_id=request.id))
        finally:
            self._snapshots -= 1
            self._answering.discard(request.id or "")
            self._set_idle_deadline()

    # -- writing -----------------------------------------------------------------

    async def _pump(self, stream: RequestStream) -> None:
        """Forward one request's events to the socket; its end is the request's end.  Events
        already queued behind one (a background chain's tokens come back several at a time,
        engine/held_results.py) go out with it in one write: one system call and one wake-up
        of the client for all of them, where each costs the decode's cores on a small CPU."""
        frames = bytearray()
        try:
            async with aclosing(deliver(self.server, stream)) as events:
                async for event in events:
                    if isinstance(event, EosEvent):
                        # The id is free once the client can see the end: it may reuse it in
                        # the very next frame, before this task runs again.
                        self._forget(stream)
                    frames += encode_event(event)
                    if stream.queued and len(frames) < WRITE_TOGETHER_BYTES:
                        continue
                    data, frames = bytes(frames), bytearray()
                    await self._send_data(data)
        finally:
            # A hang-up lands here through Cancelled; deliver() has cancelled the request.
            self._forget(stream)

    def _forget(self, stream: RequestStream) -> None:
        """Give back the request's id and place; idempotent, and never a newer request's."""
        if self.requests.get(stream.id) is stream:
            del self.requests[stream.id]
            self._set_idle_deadline()

    async def _send(self, event: ServerEvent) -> None:
        await self._send_data(encode_event(event))

    async def _send_data(self, data: bytes) -> None:
        """Write ``data`` (whole frames): at once where the socket takes it, else behind the
        lock, waiting for the reader."""
        if not self._send_lock.locked():
            # A token's frame almost always fits the socket's buffer: written at once, it
            # costs one system call, where send_all takes two passes of trio's scheduler
            # (the lock's and the socket's checkpoints) and a timer; on two cores that host
            # work per token runs beside the decode (BENCHMARKS.md "One stream on the CPU").
            # Nothing else runs until this task waits, so no other frame can come between.
            try:
                sent = self._write_at_once(data)
            except OSError:  # the client hung up: end the connection, cancelling its requests
                await self._close()
                return
            if sent == len(data):
                return
            data = data[sent:]
        async with self._send_lock:  # the rest waits for the reader, behind any other frame
            await self._send_all(data)

    def _write_at_once(self, data: bytes) -> int:
        """Bytes of ``data`` the socket takes without waiting (0 for a stream that is not a
        socket, or a full socket buffer); called with no other write under way."""
        return write_now(self._fd, data) if self._fd >= 0 else 0

    async def _send_all(self, data: bytes) -> None:
        """Write ``data`` however long the client takes to read it, up to the stall timeout;
        called holding the send lock."""
        with trio.move_on_after(self.config.stall_timeout_s) as stall:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # The client hung up: end the whole connection, which cancels its requests.
                await self._close()
        if stall.cancelled_caught:
            # The client has read nothing for that long (and half an event is now on the
            # wire): its requests are cancelled with the reason, and it is disconnected.
            log.warning(
                "connection %d read none of its events for %g s; cancelling its %d requests",
                self.number, self.config.stall_timeout_s, len(self.requests),
            )  # fmt: skip
            for stream in self.requests.values():
                stream.cancel("stalled")
            await self._close()

    async def _close(self) -> None:
        """End the connection; inside its nursery the checkpoint raises Cancelled."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        await trio.lowlevel.checkpoint()

    async def _send_error(self, error: UmaError) -> None:
        self.server.metrics.on_error(error.code)
        log.debug("connection %d: %s", self.number, shown(str(error), 300))
        await self._send(ErrorEvent(id=error.request_id, code=error.code, message=error.message))

    @property
    def busy(self) -> bool:
        """A request in flight, being admitted, or a snapshot or models request unanswered."""
        return bool(self.requests or self._admitting or self._snapshots)

    def _set_idle_deadline(self) -> None:
        idle = self.config.idle_timeout_s
        self._idle_deadline = math.inf if self.busy else trio.current_time() + idle
        if self._read_scope is not None:
            self._read_scope.deadline = self._read_deadline()


def cancelled_before_queued(request_id: str, arrived: float) -> EosEvent:
    """The end of a request its client cancelled while it was being admitted: nothing ran."""
    waited_ms = round((trio.current_time() - arrived) * 1000.0, 3)
    return EosEvent(
        id=request_id, reason="cancelled", usage=Usage(0, 0, 0),
        timings=Timings(queue_ms=waited_ms, total_ms=waited_ms), cancel_reason="client",
    )  # fmt: skip
