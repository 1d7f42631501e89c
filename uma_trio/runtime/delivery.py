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
from .session import StreamEnd
from .stream import RequestStream


async def deliver(server: RequestDesk, stream: RequestStream) -> AsyncGenerator[ServerEvent, None]:
    metrics = server.metrics
    server.open_deliveries += 1  # shutdown waits for these to write their last event
    try:
        async with stream.receive:
            async for item in stream.receive:
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
