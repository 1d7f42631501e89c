"""The front end's side of one request: what a connection or the HTTP gateway holds.

The decode loop owns the request's sequence state (:class:`~.session.Session`: its KV seq
id, ``n_past``, sampler, text filter, phase); a front end never reads it.  It holds a
:class:`RequestStream` instead: the receiving end of the request's channel, the times it
wrote each token to its client, the lane it asked for, and two verbs, :meth:`cancel` and
:meth:`set_lane`, that pass a wish to the loop.  Everything else it learns arrives through
the channel: tokens, then one :class:`~.session.StreamEnd` carrying the loop's figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import trio

from ..protocol.messages import CancelReason, Lane, Timings
from .samplers import formatted
from .session import Session, StreamEnd, StreamItem, TokenTimes, parks


class LoopControls(Protocol):
    """What a front end may ask of the decode loop about its request."""

    def cancel(self, session: Session, reason: CancelReason) -> None: ...

    def set_lane(self, session: Session, lane: Lane) -> None: ...

    def wake(self) -> None: ...


def _hung_up() -> CancelReason:
    return "disconnect"


class RequestStream:
    """One request as its front end sees it; owned by that front end."""

    def __init__(
        self, session: Session, receive: trio.MemoryReceiveChannel[StreamItem], loop: LoopControls
    ) -> None:
        self.id = session.id
        self.created = session.created  # when the request's frame arrived
        self.streamed = session.request.stream
        self.lane: Lane = session.lane  # the lane this front end last asked for
        self.tool_format = session.tool_format  # how tool calls look in its text, if offered tools
        self.formatted = formatted(session.request)  # its direct answer is its response_format's JSON
        self.prompt_tokens = len(session.prompt)
        self.receive = receive
        self.delivered_at = TokenTimes()  # when each token was written to the client
        self.load_s = 0.0  # how long it waited for its model to load (Server.open_request)
        self._session = session  # the loop's: only handed back to it
        self._loop = loop
        # Why it is cancelled when its delivery or its front end stops before the end: its
        # client hung up, unless the front end says otherwise (the rest of a failed
        # embeddings batch, http/embeddings.py).
        self.gone_reason: Callable[[], CancelReason] = _hung_up

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache gave it: known once it is admitted (0 before)."""
        return self._session.cached_tokens

    @property
    def queued(self) -> bool:
        """Items wait in the channel: the next one can be taken at once."""
        return self.receive.statistics().current_buffer_used > 0

    def cancel(self, reason: CancelReason) -> None:
        """Ask for the request to end with ``eos(cancelled)``; a no-op once it has ended."""
        self._loop.cancel(self._session, reason)

    def set_lane(self, lane: Lane) -> None:
        """Promote or demote the request from the next tick."""
        self.lane = lane
        self._loop.set_lane(self._session, lane)

    def took_one(self) -> None:
        """Called after each token taken from the channel: if that made room where the loop
        had none (it parks a stream whose buffer cannot take a token and its end), wake it,
        so the stream rejoins the batch at once."""
        stats = self.receive.statistics()
        if parks(int(stats.current_buffer_used) + 1, int(stats.max_buffer_size)):
            self._loop.wake()

    def timings(self, end: StreamEnd, now: float) -> Timings:
        """The eos timings the client felt: from the write times for a stream, else from
        the loop's sampling times (nothing is written before the end)."""
        ms = 1000.0
        started = end.admitted if end.admitted is not None else now
        timings = Timings(queue_ms=(started - self.created) * ms, total_ms=(now - self.created) * ms)
        if self.load_s > 0:
            timings.load_ms = self.load_s * ms
        times = self.delivered_at if self.streamed else end.generated_at
        if times.first is not None:
            timings.ttft_ms = (times.first - self.created) * ms
        if times.gaps:
            gaps = np.asarray(times.gaps) * ms
            # The rank rule of the daemon-wide quantiles (METRICS.md).
            timings.itl_p50_ms = float(np.percentile(gaps, 50, method="lower"))
            timings.itl_p95_ms = float(np.percentile(gaps, 95, method="lower"))
            timings.itl_max_ms = float(gaps.max())
        if times.first is not None and times.last is not None and len(times.gaps) > 0:
            span = times.last - times.first
            if span > 0:
                timings.tokens_per_s = (end.generated - 1) / span
        return timings
