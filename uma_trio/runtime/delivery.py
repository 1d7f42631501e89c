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

import msgspec
import trio

from ..protocol.messages import ServerEvent
from .desk import RequestDesk
from .session import Session, StreamEnd, StreamItem


async def deliver(
    server: RequestDesk, session: Session, receive: trio.MemoryReceiveChannel[StreamItem]
) -> AsyncGenerator[ServerEvent, None]:
    loop, metrics = server.loop, server.metrics
    server.open_deliveries += 1  # shutdown waits for these to write their last event
    try:
        async with receive:
            async for item in receive:
                if isinstance(item, StreamEnd):
                    if item.error is not None:
                        yield item.error
                    now = trio.current_time()
                    yield msgspec.structs.replace(item.final, timings=session.timings(now))
                    if item.final.reason in ("stop", "length"):
                        metrics.on_completed(session.lane, now - session.created, now)
                    return
                if session.parked:
                    loop.wake()
                yield item
                now = trio.current_time()
                ttft, gap = session.delivered_at.record(now, session.created)
                metrics.on_token_latency(session.lane, now, ttft_s=ttft, gap_s=gap)
    finally:
        server.open_deliveries -= 1
        loop.cancel(session, "disconnect")  # a no-op once the request has ended
