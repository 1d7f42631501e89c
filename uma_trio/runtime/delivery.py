"""Handing one request's events to its client, for every front end (socket, HTTP).

:func:`deliver` yields the events to write, in order: tokens, then the error
and/or eos.  The code after each ``yield`` runs only once the caller asks for
the next event, that is after it has written this one, so latency is measured
where the client feels it: TTFT and token gaps include the daemon's own
event-loop delays between sampling and writing.  Leaving the generator early
(a hang-up, a cancelled task) cancels the request, which frees its KV cells
before the next tick; callers hold it in :func:`contextlib.aclosing` so that
happens at once, not at garbage collection.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Final, overload

import msgspec
import trio

from ..protocol.messages import ServerEvent
from .desk import RequestDesk
from .session import StreamEnd, StreamItem
from .stream import RequestStream


class Beat:
    """Nothing came for a while, but the request still runs: an HTTP event stream writes
    something its client counts as activity (clients and proxies give up on a silent stream:
    Codex after 300 s, many HTTP clients' read timeouts sooner), e.g. while a long prompt is
    read or the request waits for room."""


BEAT: Final = Beat()


class _Beating:
    """``stream``'s items, with :data:`BEAT` after each ``every_s`` seconds in which none
    came: until its first token is written, and while it is in the background lane (paused
    for the interactive streams).  An interactive stream's later gaps stay within the latency
    guard, and waiting for its tokens under a timeout cost the event loop ~10 µs a token."""

    def __init__(self, stream: RequestStream, every_s: float) -> None:
        self._stream, self._every_s = stream, every_s

    def __aiter__(self) -> _Beating:
        return self

    async def __anext__(self) -> StreamItem | Beat:
        items, stream = self._stream.receive, self._stream
        try:
            try:
                return items.receive_nowait()  # queued already (as _Draining): no timer to set
            except trio.WouldBlock:
                pass
            if stream.delivered_at.first is not None and stream.lane == "interactive":
                return await items.receive()
            with trio.move_on_after(self._every_s):
                return await items.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        return BEAT


# Events queued behind one are written with it, up to this many bytes (a write the socket
# buffer takes at once): the socket's frames (runtime/connection.py), one SSE body chunk
# (http/event_stream.py).
WRITE_TOGETHER_BYTES = 65536


class _Draining:
    """``receive``'s items, those already queued taken at once: a background chain's tokens
    come back several at a time (engine/held_results.py), and waiting for each one would
    cost a pass of trio's scheduler (and a system call) a token."""

    def __init__(self, receive: trio.MemoryReceiveChannel[StreamItem]) -> None:
        self._receive = receive

    def __aiter__(self) -> _Draining:
        return self

    async def __anext__(self) -> StreamItem:
        try:
            try:
                return self._receive.receive_nowait()
            except trio.WouldBlock:
                return await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


@overload
def deliver(server: RequestDesk, stream: RequestStream) -> AsyncGenerator[ServerEvent, None]: ...


@overload
def deliver(
    server: RequestDesk, stream: RequestStream, beat_every_s: float
) -> AsyncGenerator[ServerEvent | Beat, None]: ...


async def deliver(
    server: RequestDesk, stream: RequestStream, beat_every_s: float | None = None
) -> AsyncGenerator[ServerEvent | Beat, None]:
    """The events to write; with ``beat_every_s``, :data:`BEAT` between two of them that
    came further apart than that (never after the end)."""
    metrics = server.metrics
    server.open_deliveries += 1  # shutdown waits for these to write their last event
    # The socket's streams (no beats) read the channel itself: nothing added to a token's way.
    items = _Draining(stream.receive) if beat_every_s is None else _Beating(stream, beat_every_s)
    try:
        async with stream.receive:
            async for item in items:
                if isinstance(item, Beat):
                    yield item
                    continue
                if isinstance(item, StreamEnd):
                    if item.error is not None:
                        yield item.error
                    now = trio.current_time()
                    yield msgspec.structs.replace(item.final, timings=stream.timings(item, now))
                    if item.final.reason in ("stop", "length"):
                        # An embedding (its eos carries it) generated nothing: its time is not
                        # a request duration (Metrics.on_completed leaves it out).
                        embed = item.final.embedding is not None
                        metrics.on_completed(stream.lane, now - stream.created, now, embed=embed)
                    return
                stream.took_one()
                yield item
                now = trio.current_time()
                ttft, gap = stream.delivered_at.record(now, stream.created)
                metrics.on_token_latency(stream.lane, now, ttft_s=ttft, gap_s=gap)
    finally:
        server.open_deliveries -= 1
        stream.cancel(stream.gone_reason())  # a no-op once the request has ended
