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

from .records import RequestRecord
from .scenario import ClientSpec, Scenario
from .targets import CONNECT_FAILED, CONNECTION_LOST, Target, UmaTarget

__all__ = [
    "CONNECTION_LOST", "CONNECT_FAILED", "INTERRUPTED", "RequestRecord", "ScenarioResult", "run_scenario",
]  # fmt: skip

# ``error_code`` of a request still running when the run was interrupted (Ctrl-C).
INTERRUPTED = "INTERRUPTED"


class ScenarioResult(msgspec.Struct, kw_only=True):
    scenario: Scenario
    started: float  # clock() when the scenario began: client start_s is relative to it
    finished: float  # clock() when the last client was done
    records: list[RequestRecord]  # ordered by client (as in the scenario), then index
    target: str = "uma"


async def run_scenario(
    target: Path | Target,
    scenario: Scenario,
    *,
    clock: Callable[[], float] = trio.current_time,
    on_token: Callable[[], None] | None = None,
    request_delay_s: float = 0.0,
    into: list[ScenarioResult] | None = None,
) -> ScenarioResult:
    """Run every client of ``scenario`` against ``target`` (a daemon's socket path, or any
    :class:`~.targets.Target`).  ``on_token`` is called after each token event (progress).
    ``request_delay_s``: for simulations, a machine's time per request outside the engine
    (:class:`~uma_trio.engine.sim.StepNoise` ``request_s``), waited between a request's
    ``sent`` time and sending it.  ``into``: the result is appended to it as the run starts
    and filled in as it goes, so a caller keeps what ran when the run is interrupted (its
    requests still in flight then are recorded :data:`INTERRUPTED`).

    Request failures (error events, a lost connection) are recorded, not
    raised, so one misbehaving request does not hide what the others saw; a client
    whose connection cannot be opened gets one :data:`CONNECT_FAILED` record per request
    it would have sent, with the OS error as its ``error_message``.
    """
    if isinstance(target, Path):
        target = UmaTarget(target)
    scenario = scenario.expanded()
    records: list[RequestRecord] = []
    started = clock()
    result = ScenarioResult(
        scenario=scenario, started=started, finished=started, records=records, target=target.label
    )
    if into is not None:
        into.append(result)

    async def run_client(spec: ClientSpec) -> None:
        delay = started + spec.start_s - clock()
        if delay > 0:
            await trio.sleep(delay)
        connected = False
        try:
            async with target.connect() as connection:
                connected = True
                for index in range(spec.requests):
                    if index and spec.think_s > 0:
                        await trio.sleep(spec.think_s)
                    record = RequestRecord(client=spec.name, lane=spec.lane, index=index, sent=clock())
                    records.append(record)
                    if request_delay_s > 0:
                        await trio.sleep(request_delay_s)
                    alive = await connection.run(spec, index, record, clock, on_token or _nothing)
                    if not alive:
                        return  # the connection is gone: the rest of the chain cannot run
        except OSError as exc:
            if connected:
                raise
            # A server that died (or never ran) fails this client's requests, not the whole run:
            # the other clients' records, and the runs before, are kept.
            now, why = clock(), str(exc)
            for index in range(spec.requests):
                record = RequestRecord(client=spec.name, lane=spec.lane, index=index, sent=now, ended=now)
                record.error_code, record.error_message = CONNECT_FAILED, why
                records.append(record)

    try:
        async with trio.open_nursery() as nursery:
            for spec in scenario.clients:
                nursery.start_soon(run_client, spec)
    except BaseException:
        now = clock()
        for record in records:
            if record.ended is None and record.error_code is None:
                record.ended, record.error_code = now, INTERRUPTED
        raise
    finally:
        result.finished = clock()
        order = {spec.name: i for i, spec in enumerate(scenario.clients)}
        records.sort(key=lambda r: (order[r.client], r.index))
    return result


def _nothing() -> None:
    pass
