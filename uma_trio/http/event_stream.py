"""Server-sent events over ASGI, closed at once however the response ends, with a stall
watchdog; and running a handler's work until the client disconnects."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from contextvars import ContextVar

import trio
from starlette.responses import Response

from ..runtime.delivery import WRITE_TOGETHER_BYTES
from .serve import Message, Receive, Scope, Send

log = logging.getLogger(__name__)


# The ASGI receive of the HTTP request a task serves while nobody watches it for a hang-up
# (set per request by the gateway; None inside until_disconnect's work and the tasks it
# starts: one watcher at a time, or the disconnect reaches only one of them).
UNWATCHED_RECEIVE: ContextVar[Receive | None] = ContextVar("uma_unwatched_receive", default=None)


def sticky_disconnect(receive: Receive) -> Receive:
    """``receive``, answering ``http.disconnect`` for good once it has said so.  Hypercorn
    says it once, and a request meets several watchers in turn (:func:`until_disconnect`
    around its admission, then around its answer): one whose work ended as the hang-up came
    could take the message and stop, and the next then waited for nothing while the request
    ran to its end for nobody (an editor abandoning a completion right after sending it)."""
    gone: Message | None = None

    async def receive_sticky() -> Message:
        nonlocal gone
        if gone is not None:
            await trio.lowlevel.checkpoint()
            return gone
        message = await receive()
        if message["type"] == "http.disconnect":
            gone = message
        return message

    return receive_sticky


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work``; if the client disconnects first, cancel it."""
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        watched = UNWATCHED_RECEIVE.set(None)
        try:
            await work()
        finally:
            UNWATCHED_RECEIVE.reset(watched)
        nursery.cancel_scope.cancel()


class EventStream(Response):
    """A ``text/event-stream`` response whose generator is closed at once, whether it ends,
    fails or the client disconnects (Starlette's StreamingResponse leaves that to the
    garbage collector, which would hold the request's KV cells until then)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        chunks: Callable[[], AsyncGenerator[bytes, None]],
        *,
        on_close: Callable[[], None],
        stall_timeout_s: float,
        on_stall: Callable[[], None],
        headers: dict[str, str] | None = None,
        companion: Callable[[], Awaitable[None]] | None = None,
        queued: Callable[[], bool] | None = None,
    ) -> None:
        self.status_code = 200
        # More events wait already (a background chain's tokens come back together,
        # engine/held_results.py): the chunk is sent with theirs, one write for all.
        self._queued = queued
        self._companion = companion  # runs beside the stream, ended with it (n > 1 choices)
        self.background = None
        self._chunks = chunks
        self._on_close = on_close  # runs however the response ends, even before the first chunk
        self._stall_timeout_s = stall_timeout_s  # a client reading nothing this long is cut off
        self._on_stall = on_stall
        self.init_headers({"cache-control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending_since: float | None = None  # when the body write now blocked began
        finished = False

        async def stream() -> None:
            nonlocal sending_since, finished
            async with aclosing(self._chunks()) as chunks:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                pending = b""
                async for chunk in chunks:
                    pending += chunk
                    if self._queued is not None and self._queued() and len(pending) < WRITE_TOGETHER_BYTES:
                        continue
                    await write(pending)
                    pending = b""
                if pending:  # a generator that stopped with events still queued
                    await write(pending)
            finished = True

        async def write(body: bytes) -> None:
            nonlocal sending_since
            sending_since = trio.current_time()
            await send({"type": "http.response.body", "body": body, "more_body": True})
            sending_since = None

        async def watchdog() -> None:
            # Hypercorn shields its socket writes from cancellation, so a client that reads
            # nothing is detected from outside: its request ends and frees what it held, and
            # the write stays blocked until the client goes away.
            while True:
                since = sending_since
                if since is not None and trio.current_time() - since >= self._stall_timeout_s:
                    log.warning("an HTTP client read nothing for %g s; cancelling", self._stall_timeout_s)
                    self._on_stall()
                    self._on_close()
                    return
                start = since if since is not None else trio.current_time()
                await trio.sleep_until(start + self._stall_timeout_s)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watchdog)
                if self._companion is not None:
                    nursery.start_soon(self._companion)
                await until_disconnect(receive, stream)
                nursery.cancel_scope.cancel()
        finally:
            self._on_close()
        if finished:
            # Outside the disconnect watcher: with `Connection: close` hypercorn reports the
            # disconnect while it finishes this send, and cancelling the send then left the
            # socket open after the body had ended.
            await send({"type": "http.response.body", "body": b"", "more_body": False})
