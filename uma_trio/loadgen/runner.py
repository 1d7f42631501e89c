"""Run a :class:`~.scenario.Scenario` against a daemon and record when every token arrived.

Every client runs concurrently in one trio nursery, on its own
:class:`~uma_trio.client.UmaClient` connection.  All times come from
``clock()`` (default :func:`trio.current_time`), so under
``trio.testing.MockClock`` the records hold virtual seconds and a simulation
test can reason about them exactly; against the real daemon they are
monotonic wall seconds.  Nothing here computes statistics (see :mod:`.stats`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import trio

from ..client import ConnectionLost, UmaClient
from ..protocol.messages import EosEvent, ErrorEvent, FinishReason, TokenEvent
from .scenario import ClientSpec, Lane, Scenario

# ``error_code`` of a request whose connection died under it (not a daemon error code).
CONNECTION_LOST = "CONNECTION_LOST"


class RequestRecord(msgspec.Struct, kw_only=True):
    """What one client saw of one request; all times are ``clock()`` values."""

    client: str
    lane: Lane
    index: int  # position in the client's chain, from 0
    sent: float
    token_times: list[float] = msgspec.field(default_factory=list)  # one per token event
    ended: float | None = None  # when the eos (or error) arrived
    eos_reason: FinishReason | None = None
    error_code: str | None = None
    prompt_tokens: int | None = None  # from the eos usage
    completion_tokens: int | None = None  # from the eos usage (a token event may carry several)

    @property
    def ok(self) -> bool:
        """Ended normally: by a stop or by reaching ``max_tokens``."""
        return self.error_code is None and self.eos_reason in ("stop", "length")


class ScenarioResult(msgspec.Struct, kw_only=True):
    scenario: Scenario
    started: float  # clock() when the scenario began: client start_s is relative to it
    finished: float  # clock() when the last client was done
    records: list[RequestRecord]  # ordered by client (as in the scenario), then index


async def run_scenario(
    socket_path: Path, scenario: Scenario, *, clock: Callable[[], float] = trio.current_time
) -> ScenarioResult:
    """Run every client of ``scenario`` against the daemon at ``socket_path``.

    Request failures (error events, a lost connection) are recorded, not
    raised, so one misbehaving request does not hide what the others saw; a
    connection that cannot be opened at all raises.
    """
    records: list[RequestRecord] = []
    started = clock()

    async def run_client(spec: ClientSpec) -> None:
        delay = started + spec.start_s - clock()
        if delay > 0:
            await trio.sleep(delay)
        async with UmaClient.connect(socket_path) as client:
            for index in range(spec.requests):
                if index and spec.think_s > 0:
                    await trio.sleep(spec.think_s)
                record = RequestRecord(client=spec.name, lane=spec.lane, index=index, sent=clock())
                records.append(record)
                if not await _run_request(client, spec, index, record, clock):
                    return  # the connection is gone: the rest of the chain cannot run

    async with trio.open_nursery() as nursery:
        for spec in scenario.clients:
            nursery.start_soon(run_client, spec)
    finished = clock()
    order = {spec.name: i for i, spec in enumerate(scenario.clients)}
    records.sort(key=lambda r: (order[r.client], r.index))
    return ScenarioResult(scenario=scenario, started=started, finished=finished, records=records)


async def _run_request(
    client: UmaClient, spec: ClientSpec, index: int, record: RequestRecord, clock: Callable[[], float]
) -> bool:
    """Stream one request into ``record``; False when the connection was lost."""
    try:
        async with client.stream(**spec.request(index)) as events:
            async for event in events:
                now = clock()
                if isinstance(event, TokenEvent):
                    record.token_times.append(now)
                elif isinstance(event, EosEvent):
                    record.ended, record.eos_reason = now, event.reason
                    record.prompt_tokens = event.usage.prompt_tokens
                    record.completion_tokens = event.usage.completion_tokens
                elif isinstance(event, ErrorEvent):
                    # The client's stream ends at an error event (a following eos is not seen).
                    record.ended, record.error_code = now, event.code
    except ConnectionLost:
        record.ended, record.error_code = clock(), CONNECTION_LOST
        return False
    if record.ended is None:  # the stream ended without eos or error
        record.ended, record.error_code = clock(), CONNECTION_LOST
        return False
    return True
